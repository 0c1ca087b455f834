"""What `tools/bench_retrieval.py` measures per passage ratio C, and its report:
one `Row` per C (index bytes, encoding, build and scoring seconds, analytical expectations),
every quantity as a ratio to the C = 1 row, the Markdown tables, JSON lines and the plot of
measured against expected ratios. The tool measures; this module only reads rows, so a
partial run (rows not yet scored) reports what it has.
"""
import dataclasses
import json
import statistics
from typing import Dict, List, Optional, Sequence

from tools import results_files


@dataclasses.dataclass
class Row:
  """What one passage ratio measured (seconds, bytes, counts) and what was expected."""
  ratio: int
  num_docs: int
  num_vectors: int
  expected_vectors: int          # sum_i ceil(n_i / C) over the tokenized passages
  dim: int
  index_bytes: int               # Index.nbytes
  expected_bytes: int            # expected_vectors * dim * bytes per value
  compile_s: float               # the encoder's compilation, all widths
  encode_s: List[float]          # time inside the encoder calls: the build's, then reruns
  build_s: float                 # the whole build_index call (encode + write)
  encoder_flops: float           # analytical, over the padded batches
  scoring_first_s: float = 0.0   # the untimed first search (compilation included)
  scoring_s: List[float] = dataclasses.field(default_factory=list)
  valid_pairs: int = 0           # valid query vectors x stored passage vectors
  computed_pairs: int = 0        # query x passage vector pairs Index.search computes

  @property
  def vectors_per_passage(self) -> float:
    return self.num_vectors / self.num_docs

  @property
  def encode_median(self) -> float:
    return statistics.median(self.encode_s)

  @property
  def scoring_median(self) -> Optional[float]:
    """None before the first scoring repeat (a partial run)."""
    return statistics.median(self.scoring_s) if self.scoring_s else None



def ratios_to_first(rows: Sequence[Row]) -> List[Dict[str, Optional[float]]]:
  """Every row's measured and expected quantities divided by those of the C = 1 row; the
  scoring ones None while the row or C = 1 is not scored yet (a partial run)."""
  base = rows[0]
  out = []
  for row in rows:
    out.append({
        "index_bytes": row.index_bytes / base.index_bytes,
        "expected_bytes": row.expected_bytes / base.expected_bytes,
        "inverse_ratio": 1.0 / row.ratio,
        "encode": row.encode_median / base.encode_median,
        "build": row.build_s / base.build_s,
        "encoder_flops": row.encoder_flops / base.encoder_flops,
        **_scoring_ratios(row, base)})
  return out


def _scoring_ratios(row: Row, base: Row) -> Dict[str, Optional[float]]:
  if not (row.scoring_s and base.scoring_s):
    return dict.fromkeys(("scoring", "valid_pairs", "computed_pairs"))
  return {"scoring": row.scoring_median / base.scoring_median,
          "valid_pairs": row.valid_pairs / base.valid_pairs,
          "computed_pairs": row.computed_pairs / base.computed_pairs}


def json_rows(rows: Sequence[Row]) -> List[str]:
  lines = []
  for row, rel in zip(rows, ratios_to_first(rows)):
    record = dataclasses.asdict(row)
    record.update(vectors_per_passage=row.vectors_per_passage,
                  encode_median_s=row.encode_median, scoring_median_s=row.scoring_median,
                  ratios_to_c1={k: v if v is None else round(v, 6) for k, v in rel.items()})
    lines.append(json.dumps(record, sort_keys=True))
  return lines


def tables(rows: Sequence[Row]) -> List[str]:
  rel = ratios_to_first(rows)
  lines = ["## Index size", "",
           "| C | vectors / passage | index MiB | index bytes / C=1 | expected: "
           "Σ⌈n/C⌉ / Σn | 1/C |", "|---|---|---|---|---|---|"]
  for row, r in zip(rows, rel):
    lines.append(f"| {row.ratio} | {row.vectors_per_passage:.2f} | "
                 f"{row.index_bytes / 2**20:.2f} | {r['index_bytes']:.3f} | "
                 f"{r['expected_bytes']:.3f} | {r['inverse_ratio']:.3f} |")
  lines += ["", "## Corpus encoding", "",
            "| C | encode s, median (min-max) | encode / C=1 | expected: encoder FLOPs / "
            "C=1 | encoder GFLOP | build s (encode + write) | build / C=1 | compile s |",
            "|---|---|---|---|---|---|---|---|"]
  for row, r in zip(rows, rel):
    lines.append(f"| {row.ratio} | {row.encode_median:.2f} ({min(row.encode_s):.2f}-"
                 f"{max(row.encode_s):.2f}) | {r['encode']:.2f} | "
                 f"{r['encoder_flops']:.2f} | {row.encoder_flops / 1e9:.1f} | "
                 f"{row.build_s:.2f} | {r['build']:.2f} | {row.compile_s:.2f} |")
  lines += ["", "## Query scoring", "",
            "| C | scoring s, median (min-max) | scoring / C=1 | expected: valid vector "
            "pairs / C=1 | vector pairs as computed (padded) / C=1 | first call s |",
            "|---|---|---|---|---|---|"]
  for row, r in ((row, r) for row, r in zip(rows, rel) if r["scoring"] is not None):
    lines.append(f"| {row.ratio} | {row.scoring_median:.3f} ({min(row.scoring_s):.3f}-"
                 f"{max(row.scoring_s):.3f}) | {r['scoring']:.2f} | {r['valid_pairs']:.3f} | "
                 f"{r['computed_pairs']:.3f} | {row.scoring_first_s:.2f} |")
  return lines



def plot(rows: Sequence[Row], path: str) -> None:
  """Measured ratios to C = 1 (solid) against their expectations (dashed)."""
  plt = results_files.pyplot()
  rel = ratios_to_first(rows)
  xs = [row.ratio for row in rows]
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for measured, expected, label, color in (
      ("index_bytes", "expected_bytes", "index bytes", "C0"),
      ("encode", "encoder_flops", "encoding time", "C1"),
      ("scoring", "valid_pairs", "scoring time", "C2")):
    known = [(x, r) for x, r in zip(xs, rel) if r[measured] is not None]  # not yet scored: None
    if not known:
      continue
    at = [x for x, _ in known]
    ax.plot(at, [r[measured] for _, r in known], "o-", color=color, label=f"{label} (measured)")
    ax.plot(at, [r[expected] for _, r in known], "s--", color=color, alpha=0.6,
            label=f"{label} (expected)")
  ax.plot(xs, [1 / x for x in xs], ":", color="gray", label="1/C")
  results_files.log_log_axes(ax, "passage compression ratio C", None, "ratio to C = 1",
                             xbase=2, ybase=2, fontsize=7)
  ax.set_xticks(xs, [str(x) for x in xs])
  fig.tight_layout()
  results_files.save_figure(fig, path)
