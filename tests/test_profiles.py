"""tools/profiles.py: the trace readers, the ops' JAX operations and parts of the step,
and the memory traffic read from a compiled program's text, on hand-made traces and HLO."""
import argparse

from tools import profiles


def _trace(*planes):
  """A stand-in for jax.profiler.ProfileData: planes of lines of events, each event a
  (name, duration ns, stats) triple."""
  event = lambda name, ns, stats: argparse.Namespace(name=name, duration_ns=ns,
                                                     stats=list(stats.items()))
  return argparse.Namespace(planes=[argparse.Namespace(name=plane, lines=[
      argparse.Namespace(name=line, events=[event(*e) for e in events])
      for line, events in lines.items()]) for plane, lines in planes])


def test_op_events_read_each_kind_of_trace():
  """XProf's derived "XLA Ops" line when present; a GPU's raw CUPTI trace (kernels on stream
  lines, an `hlo_op` stat naming the HLO op) otherwise; kernel names when no stat names one;
  the host's HLO-op events on the CPU."""
  derived = _trace(("/device:TPU:0", {"XLA Ops": [("fusion.1", 30, {})],
                                      "XLA Modules": [("jit_step", 99, {})]}))
  assert list(profiles._op_events(derived)) == [("fusion.1", 30)]
  cupti = _trace(("/host:CPU", {"python": [("step", 500, {})]}),
                 ("/device:GPU:0", {"Stream #13(compute)": [
                     ("loop_fusion_kernel", 7, {"hlo_op": "fusion.2", "hlo_module": "m"}),
                     ("cutlass_gemm_bf16", 40, {"hlo_op": "custom-call.3"})],
                     "Stream #14(memcpy)": [("memcpy", 2, {})]}))
  assert list(profiles._op_events(cupti)) == [("fusion.2", 7), ("custom-call.3", 40)]
  bare = _trace(("/device:GPU:0", {"Stream #13": [("sm90_xmma_gemm", 40, {})],
                                   "Launch Stats": [("launch", 1, {})]}))
  assert list(profiles._op_events(bare)) == [("sm90_xmma_gemm", 40)]
  cpu = _trace(("/host:CPU", {"XLA pool": [("dot.4", 12, {"hlo_op": "dot.4"}),
                                           ("schedule", 3, {})]}))
  assert list(profiles._op_events(cpu)) == [("dot.4", 12)]


def _instruction(name: str, call: str, op_name: str = "") -> str:
  meta = f', metadata={{op_name="jit(step_fn)/{op_name}"}}' if op_name else ""
  return f"  %{name} = f32[4]{{0}} {call}{meta}"


ENCODER = "jvp(Transformer)/Transformer.encode/encoder"
HLO = "\n".join(["HloModule jit_step_fn", "ENTRY %main {", *(_instruction(*i) for i in [
    ("custom-call.1", 'custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"',
     f"{ENCODER}/layers_0/self_attention/query/dot_general"),
    ("loop_convert_fusion", "fusion(%c), kind=kLoop, calls=%fused_convert",
     f"transpose({ENCODER})/relpos_bias/jit(_one_hot)/convert_element_type"),
    ("input_reduce_fusion.7", "fusion(%d), kind=kInput, calls=%fused_reduce",
     f"{ENCODER}/layers_0/pre_attention_layer_norm/reduce_sum"),
    ("dot.3", "dot(%e, %f), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
     "transpose(jvp(Transformer))/Transformer.decode/decoder/layers_1/mlp/wo/dot_general"),
    ("input_reduce_fusion.9", "fusion(%g), kind=kInput, calls=%fused_reduce.2", "reduce_sum"),
    ("loop_multiply_fusion", "fusion(%h), kind=kLoop, calls=%fused_multiply",
     "transpose(jvp())/mul"),
    ("copy.5", "copy(%i)"),
    ("ynn_fusion.2", "fusion(%j, %k), kind=kCustom, calls=%fused_dot")]), "}", "",
    "%fused_dot (p0: f32[4,4], p1: f32[4,4]) -> f32[4] {",  # its metadata inside (CPU)
    _instruction("dot.9", "dot(%p0, %p1), lhs_contracting_dims={1}",
                 f"{ENCODER}/layers_0/mlp/wi_0/dot_general"), "}"])


def test_hlo_ops_name_each_instruction_s_jax_operation_and_its_matmuls():
  ops = profiles.hlo_ops(HLO)
  assert ops["custom-call.1"] == (
      f"jit(step_fn)/{ENCODER}/layers_0/self_attention/query/dot_general", True)
  assert ops["dot.3"][1] and not ops["loop_convert_fusion"][1]
  assert not ops["input_reduce_fusion.7"][1] and ops["copy.5"] == ("", False)
  assert ops["ynn_fusion.2"] == (  # a fusion whose computation holds a dot (the CPU's)
      f"jit(step_fn)/{ENCODER}/layers_0/mlp/wi_0/dot_general", True)


def test_op_time_by_part_of_the_step_hand_worked():
  """The norm is named for attention too (`pre_attention_layer_norm`) and counts as a norm; a
  reduction outside the forward and backward is the optimizer's; the loss's `mul` sits under
  the step's own jvp; an op without metadata, or not in the program, is unattributed.
  Total 20 ms: attention 5 (all matmul), relative bias 4, MLP 3 (matmul), optimizer 3,
  norms 2, loss 1, unattributed 1 + 1."""
  ms = {"custom-call.1": 5.0, "loop_convert_fusion": 4.0, "dot.3": 3.0,
        "input_reduce_fusion.9": 3.0, "input_reduce_fusion.7": 2.0,
        "loop_multiply_fusion": 1.0, "copy.5": 1.0, "sm90_gemm_kernel": 1.0}
  parts = {p["part"]: p for p in profiles.op_parts(ms, profiles.hlo_ops(HLO))}
  assert [p["part"] for p in profiles.op_parts(ms, profiles.hlo_ops(HLO))][:2] == [
      "attention", "relative position bias"]
  want = {"attention": (5, 5, 1), "relative position bias": (4, 0, 1), "MLP": (3, 3, 1),
          "optimizer": (3, 0, 1), "layer norms": (2, 0, 1), "loss": (1, 0, 1),
          "unattributed": (2, 0, 2)}
  assert {k: (p["ms_per_step"], p["matmul_ms_per_step"], p["ops"])
          for k, p in parts.items()} == want
  assert parts["attention"]["share"] == 5 / 20 and parts["unattributed"]["share"] == 2 / 20
  top = profiles.top_ops(ms, profiles.hlo_ops(HLO), count=2)
  assert [(o["op"], o["ms_per_step"], o["share"]) for o in top] == [
      ("custom-call.1", 5.0, 0.25), ("loop_convert_fusion", 4.0, 0.2)]
  assert top[1]["jax_op"].endswith("relpos_bias/jit(_one_hot)/convert_element_type")


TRAFFIC_HLO = """HloModule jit_step_fn
ENTRY %main (p0: bf16[8,4], p1: bf16[4,2]) -> f32[8,2] {
  %p0 = bf16[8,4]{1,0} parameter(0)
  %p1 = bf16[4,2]{1,0} parameter(1)
  %custom-call.1 = bf16[8,2]{1,0} custom-call(%p0, %p1), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step_fn)/jvp(Transformer)/Transformer.encode/encoder/layers_0/mlp/wi/dot_general"}
  %fusion.2 = (f32[8,2]{1,0}, s32[3]{0}) fusion(%custom-call.1), kind=kLoop, calls=%fused, metadata={op_name="jit(step_fn)/reduce_sum"}
  %get-tuple-element.4 = f32[8,2]{1,0} get-tuple-element(%fusion.2), index=0
  ROOT %copy.3 = f32[8,2]{1,0} copy(%get-tuple-element.4)
}
"""


def test_traffic_by_part_hand_worked():
  """Each kernel reads its operands and writes its output once: the cuBLAS call 8x4 + 4x2
  bf16 in, 8x2 bf16 out = 64 + 16 + 32 = 112 bytes (MLP, a matmul); the optimizer's fusion
  reads those 32 and writes an (f32[8,2], s32[3]) tuple, 64 + 12: 108; the copy without
  metadata reads and writes 64 (unattributed); parameters and tuple reads are no kernels."""
  rows = profiles.traffic_parts(TRAFFIC_HLO, profiles.hlo_ops(TRAFFIC_HLO))
  parts = {p["part"]: p for p in rows}
  assert {k: (round(p["gb"] * 1e9), round(p["matmul_gb"] * 1e9), p["kernels"])
          for k, p in parts.items()} == {"MLP": (112, 112, 1), "optimizer": (108, 0, 1),
                                         "unattributed": (128, 0, 1)}
  assert [p["part"] for p in rows] == [
      "unattributed", "MLP", "optimizer"]
