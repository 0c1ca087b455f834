# python -m decal_jax.commands.export_t5x --checkpoint runs/decal_tiny --out /ckpt/decal_tiny_t5x
# python -m decal_jax.commands.export_t5x --checkpoint runs/t5_tiny/checkpoint_2000 --out /ckpt/t5_t5x \
#     --t5x_names
"""Writes the params of a decal_jax checkpoint as a T5X checkpoint (`--out/checkpoint_<step>`,
msgpack + TensorStore: `t5x.eval`, `t5x.infer` and `t5x.checkpoints` restore it).

--checkpoint: a MODEL_DIR (its latest checkpoint) or one of its checkpoint_<step> folders.
The names stay decal_jax's by default, for T5X runs of the decal_jax network (the drop-in
gin files in gin/t5x/, with the same SCAN_LAYERS / FUSED_QKV as the run that wrote it).
--t5x_names renames a plain T5 (no compressor parameters, 32 relative-position buckets)
to T5X's own network (t5x/examples/t5/network.py), unrolled and with 2-D kernels.
Only the params are written (T5X's eval / infer restore no optimizer state). The library
side is `decal_jax.interop.t5x_checkpoints`; docs/t5x_checkpoints.md has the whole round trip.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True,
                      help="a decal_jax MODEL_DIR or one of its checkpoint_<step> folders")
  parser.add_argument("--out", required=True, help="the T5X MODEL_DIR to write into")
  parser.add_argument("--t5x_names", action="store_true",
                      help="T5X's own T5 network names (a plain T5 only)")
  args = parser.parse_args(argv)
  from decal_jax.interop import t5x_checkpoints
  from decal_jax.runtime import checkpoints
  try:
    source, step, params = checkpoints.read_saved_params(args.checkpoint)
    if args.t5x_names:
      params = t5x_checkpoints.to_t5x_names(params)
    written = t5x_checkpoints.write_t5x_checkpoint(params, args.out, step)
  except (FileNotFoundError, FileExistsError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  names = "T5X network" if args.t5x_names else "decal_jax"
  print(f"{source}: {len(params)} params written with {names} names to {written}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
