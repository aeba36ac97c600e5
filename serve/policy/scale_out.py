"""Several replicas: one command each, and an nginx upstream in front."""

from __future__ import annotations

from collections.abc import Sequence

from tuneport.convert.errors import UserError


# -- scale-out ------------------------------------------------------------------------------------
def _with_port(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` with any ``--port`` replaced by ``port`` (before a ``--`` that starts pass-through flags)."""
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:cut], argv[cut:]
    out: list[str] = []
    skip = False
    for a in head:
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return [*out, "--port", str(port), *tail]


def replica_commands(tuneport_argv: list[str], replicas: int, gpus_per_replica: int, base_port: int) -> list[dict]:
    """One command per replica: its own GPUs (CUDA_VISIBLE_DEVICES, also honoured by ROCm) and port.
    Ports go up in twos: a replica's vLLM listens on its gateway port + 1."""
    if replicas < 1 or gpus_per_replica < 0:
        raise UserError(f"--replicas {replicas} --gpus-per-replica {gpus_per_replica}",
                        "need at least one replica and zero or more GPUs each")
    out = []
    for i in range(replicas):
        port = base_port + 2 * i
        gpus = ",".join(str(g) for g in range(i * gpus_per_replica, (i + 1) * gpus_per_replica))
        env = {"CUDA_VISIBLE_DEVICES": gpus} if gpus_per_replica else {}
        where = f"GPU {gpus}" if gpus_per_replica else "CPU"
        out.append({"what": f"replica {i + 1}/{replicas}: {where}, port {port}", "env": env,
                    "argv": _with_port(tuneport_argv, port)})
    return out


def nginx_upstream(ports: Sequence[int], listen_port: int, *, host: str = "127.0.0.1",
                   sticky_header: str | None = None, name: str = "tuneport") -> str:
    """An nginx snippet (inside ``http {}``): the replicas as one upstream, least connections first, or
    a consistent hash of ``sticky_header`` (e.g. "X-Adapter") so an adapter keeps hitting one replica;
    no buffering (SSE streams token by token) and hour-long timeouts for long generations."""
    balance = (f"hash $http_{sticky_header.lower().replace('-', '_')} consistent;" if sticky_header
               else "least_conn;")
    servers = "\n".join(f"    server {host}:{p} max_fails=3 fail_timeout=30s;" for p in ports)
    return f"""upstream {name} {{
    {balance}
{servers}
    keepalive 32;
}}

server {{
    listen {listen_port};
    location / {{
        proxy_pass http://{name};
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_buffering off;
        proxy_cache off;
        proxy_read_timeout 3600s;
        proxy_send_timeout 3600s;
    }}
}}
"""
