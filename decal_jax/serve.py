# python -m decal_jax.serve --model_dir=runs/decal_tiny_retrieval --gin_file=models/decal_tiny.gin --gin_file=models/dual_encoder.gin --query_length=16
"""Serves a retrieval MODEL_DIR's index over HTTP: GET/POST /search, /health, /info, /stats
(`search_server.main`; needs `pip install 'decal_jax[serve]'`). Binds 127.0.0.1 unless
told otherwise; a bearer token (--token_file) guards it; SIGTERM drains in-flight
requests."""
from decal_jax.runtime import search_server


def main(argv=None):
  search_server.main(argv)


if __name__ == "__main__":
  main()
