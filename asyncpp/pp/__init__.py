"""Pipeline parallelism: blocks on a vLLM engine split across stages."""
