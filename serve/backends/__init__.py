"""The engines behind the backend contract (:mod:`tuneport.serve.backend`): ``inprocess`` answers for engines
that generate tokens in this process (llama.cpp, MLX, ExLlamaV3), ``upstream`` forwards to an OpenAI server in a
child process (vLLM, TabbyAPI); one module per engine, each registered in :mod:`tuneport.serve.registry`."""
