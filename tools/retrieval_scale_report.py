"""What `tools/bench_retrieval_scale.py` reports from its rows: the Markdown tables (per
corpus, one row per C, search, bit width and sweep setting), the wall-time line, the page
with its header and JSON lines, and the plot of bytes per passage against NDCG@10. The tool
measures; this module only reads rows (and the tool's arguments and corpora), so a partial
run reports what it has.
"""
import json
import os
from typing import List, Sequence

from decal_jax.retrieval import residual_search
from tools import benchmarking, results_files


def tables(rows: List[dict]) -> List[str]:
  """One Markdown table per corpus, a line per row (exact, then the approximate sweep)."""
  lines = []
  for name in dict.fromkeys(r["corpus"] for r in rows):
    lines += [f"## {name}", "", "| C | search | residual bits | nprobe | query cells | "
              "candidates | bytes / passage | NDCG@10 | NDCG@10 - exact | Recall@100 | "
              "Recall@100 / exact | share of exact top-k | queries/s | x exact | build s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["corpus"] == name):
      loss = f"{-r['ndcg_loss']:+.4f}" if "ndcg_loss" in r else "-"
      ratio = f"{r['recall@100_vs_exact']:.4f}" if "ndcg_loss" in r else "-"
      search = f"{r['search']} ({r['backend']})" if "backend" in r else r["search"]
      lines.append(f"| {r['ratio']} | {search} | {r['bits']} | {r.get('nprobe', '-')} | "
                   f"{r.get('query_cells', '-')} | {r.get('candidates', '-')} | "
                   f"{r['bytes_per_passage']:.0f} | {r['ndcg@10']:.4f} | {loss} | "
                   f"{r['recall@100']:.4f} | {ratio} | {r['recall_vs_exact']:.4f} | "
                   f"{r['queries_per_s']:.1f} | {r.get('speed_vs_exact', 1.0):.1f} | "
                   f"{r['build_s']:.1f} |")
    lines.append("")
  return lines


def wall_line(rows: List[dict], wall_s: float) -> str:
  """The run's wall time and what it went to: index builds (exact; residual, once per bit
  width), searches (queries / queries per second, every row), the rest (corpus and query
  generation, metrics)."""
  exact = sum(r["build_s"] for r in rows if r["search"] == "exact")
  compressed = sum({(r["corpus"], r["ratio"], r["bits"]): r["build_s"] for r in rows
                    if r["search"] == "approximate"}.values())
  searches = {kind: sum(r["num_queries"] / r["queries_per_s"] for r in rows
                        if r["search"] == kind) for kind in ("exact", "approximate")}
  return (f"wall time: {wall_s / 60:.1f} min in all: exact index builds {exact / 60:.1f}, "
          f"residual index builds {compressed / 60:.1f}, exact searches "
          f"{searches['exact'] / 60:.1f}, approximate searches "
          f"{searches['approximate'] / 60:.1f}, the rest (corpus, queries, measures) "
          f"{(wall_s - exact - compressed - sum(searches.values())) / 60:.1f}")


def markdown(args, rows: List[dict], corpora: Sequence) -> str:
  """The page: header (corpora, encoder, search settings, load, wall time), tables, plot
  link and JSON lines; `corpora`: bench_retrieval_scale's Corpus (name, doc_ids, qids)."""
  lines = benchmarking.header(
      "Exact vs approximate multi-vector search: index bytes per passage against NDCG@10",
      args.command,
      "corpora: " + "; ".join(f"{c.name} ({len(c.doc_ids)} passages, {len(c.qids)} queries)"
                              for c in corpora),
      f"encoder: the training-free stand-in of tools/bench_retrieval_scale.py (d = "
      f"{args.dim}; passages cut to {args.passage_length} words, queries to "
      f"{args.query_length}); exact index float16",
      f"approximate: nprobe, query cells and candidates per row (defaults: nprobe "
      f"{residual_search.DEFAULT_NPROBE}, query cells {residual_search.DEFAULT_QUERY_CELLS}, "
      f"candidates max(4 top_k, min(docs, 4096))); the plain centroid interaction over every "
      f"candidate keeps max({residual_search.REFINED_KEEP}, 4 x candidates) for the refined "
      f"one; centroids "
      f"{args.num_centroids} x ColBERTv2's default (2^floor(log2(16 sqrt(vectors)))), "
      f"k-means on {args.sample_vectors:,} sampled vectors, 10 iterations, shared by the bit "
      f"widths of one C; nearest-centroid search "
      + (f"two-level (the best of {args.centroid_probe} probed coarse cells, "
         "codec.nearest_centroids)" if args.centroid_probe else "exhaustive")
      + f"; residual quantizer {', '.join(args.quantizers)} (codec.py); "
      f"top {args.top_k}",
      "bytes / passage: the codes and residuals (exact: the float16 vectors) over the "
      "passages; the centroid table is apart (JSON rows, centroid_bytes_per_passage). recall "
      f"of exact top-k: the share of the exact top {args.top_k} that approximate search "
      "returns. queries/s: all queries in one call, on this machine's cores (exact: "
      "jit-compiled JAX, first call, compilation included; approximate: batches of "
      "queries, stages 2-4 by the backend in the search column (numpy, or compiled: "
      "numba's kernels.py, one thread per core, compiled before timing)); x exact: over "
      "the exact scan's queries/s "
      "at the same C in the same run.",
      f"host load average (1/5/15 min) before / after: {args.load_before} / "
      f"{args.load_after}", wall_line(rows, args.wall_s), args.note and f"note: {args.note}")
  lines += ["", *tables(rows)]
  if args.plot:
    lines += [f"![bytes per passage vs NDCG@10]({os.path.basename(args.plot)})", ""]
  lines += ["## Rows (JSON lines)", "", "```jsonl",
            *(json.dumps(r, sort_keys=True) for r in rows), "```"]
  return "\n".join(lines) + "\n"


def plot(rows: List[dict], path: str) -> None:
  """Bytes per passage (log) vs NDCG@10, one line per corpus and C (points: bit widths;
  the square: exact)."""
  plt = results_files.pyplot()
  names = list(dict.fromkeys(r["corpus"] for r in rows))
  fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2), squeeze=False)
  for ax, name in zip(axes[0], names):
    for j, ratio in enumerate(dict.fromkeys(r["ratio"] for r in rows)):
      mine = [r for r in rows if r["corpus"] == name and r["ratio"] == ratio]
      approx = [r for r in mine if r["search"] == "approximate"]
      color = f"C{j}"
      ax.plot([r["bytes_per_passage"] for r in approx], [r["ndcg@10"] for r in approx], "o-",
              color=color, label=f"C = {ratio}")
      for r in approx:
        ax.annotate(str(r["bits"]), (r["bytes_per_passage"], r["ndcg@10"]), fontsize=6)
      ax.plot([r["bytes_per_passage"] for r in mine if r["search"] == "exact"],
              [r["ndcg@10"] for r in mine if r["search"] == "exact"], "s", color=color)
    ax.set_xscale("log")
    ax.set_xlabel("index bytes per passage (log)")
    ax.set_ylabel("NDCG@10")
    ax.set_title(name, fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  results_files.save_figure(fig, path)

