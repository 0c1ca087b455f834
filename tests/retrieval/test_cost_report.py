"""tools/retrieval_cost_report.py on rows worked by hand: ratios to the C = 1 row, a
partial run's unscored rows, the tables and JSON lines a results file is made of."""
import json

import pytest

from tools import retrieval_cost_report as cost_report


def _row(ratio, index_bytes, encode_s, scoring_s=()):
  # 10 passages of 8 tokens: sum ceil(8 / C) vectors of dim 4 in float16 (2 bytes).
  vectors = 10 * -(-8 // ratio)
  return cost_report.Row(ratio=ratio, num_docs=10, num_vectors=vectors,
                         expected_vectors=vectors, dim=4, index_bytes=index_bytes,
                         expected_bytes=vectors * 4 * 2, compile_s=0.5, encode_s=list(encode_s),
                         build_s=2.0 * ratio, encoder_flops=100.0 + 10 * ratio,
                         scoring_s=list(scoring_s), valid_pairs=6 * vectors,
                         computed_pairs=8 * vectors)


def test_ratios_to_the_c1_row_by_hand():
  rows = [_row(1, 1000, [4.0, 2.0, 3.0], [1.0, 3.0, 2.0]), _row(4, 260, [1.0], [0.5])]
  base, four = cost_report.ratios_to_first(rows)
  assert all(value == 1.0 for value in base.values())
  assert four["index_bytes"] == pytest.approx(0.26)
  assert four["expected_bytes"] == pytest.approx(20 / 80)  # 10 x 2 vectors against 10 x 8
  assert four["inverse_ratio"] == 0.25
  assert four["encode"] == pytest.approx(1.0 / 3.0)  # medians: 3.0 at C = 1
  assert four["scoring"] == pytest.approx(0.5 / 2.0)
  assert four["build"] == pytest.approx(4.0)
  assert four["encoder_flops"] == pytest.approx(140.0 / 110.0)
  assert four["valid_pairs"] == four["computed_pairs"] == pytest.approx(0.25)


def test_a_partial_run_reports_unscored_rows_as_none():
  rows = [_row(1, 1000, [3.0], [2.0]), _row(2, 500, [2.0])]  # C = 2 not scored yet
  rel = cost_report.ratios_to_first(rows)
  assert rel[1]["scoring"] is None and rel[1]["valid_pairs"] is None
  assert rel[1]["index_bytes"] == 0.5
  text = "\n".join(cost_report.tables(rows))
  scoring = text.split("## Query scoring", 1)[1]
  assert "| 1 | 2.000 (2.000-2.000) | 1.00 |" in scoring
  assert "| 2 |" not in scoring  # the index and encoding tables have it, scoring not yet
  assert "| 2 | 4.00 | 0.00 | 0.500 |" in text  # vectors / passage, MiB, bytes / C=1
  records = [json.loads(line) for line in cost_report.json_rows(rows)]
  assert records[1]["scoring_median_s"] is None
  assert records[1]["ratios_to_c1"]["index_bytes"] == 0.5
  assert records[0]["encode_median_s"] == 3.0

