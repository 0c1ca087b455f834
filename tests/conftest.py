"""Test-session setup shared by every test module."""
import sys

# TensorFlow (which seqio imports) and Triton's compiler library crash the process when
# Triton is loaded second; transformers' PyTorch models import it through torch._dynamo.
# The tests run PyTorch on CPU only, which needs no Triton: hide it before torch looks.
if "triton" not in sys.modules:
  sys.modules["triton"] = None
