"""The OpenAI-compatible gateway (FastAPI) over one :class:`~tuneport.serve.backend.Backend`.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (OpenAI); ``/v1/adapters`` (admin);
``/health``, ``/metrics`` (operations). With an API key every route needs ``Authorization: Bearer <key>``;
with an admin key the admin routes need that one; limits on ``max_tokens`` and on requests in flight per key;
adapter paths must lie inside ``--adapter-dir`` or the start-up paths, links followed; adapter names match
``[A-Za-z0-9._-]{1,64}``; bodies are bounded in size and time however they are framed (:mod:`.limits`); every
request gets one access-log line.
"""

from ..limits import HttpLimits
from .app import create_app

__all__ = ["HttpLimits", "create_app"]
