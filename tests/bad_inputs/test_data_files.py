"""Bad data files: a line that is not UTF-8 in each reader (downstream JSONL, text LM, Squid QA,
eval inputs, make_vocab input), release layouts prepare_jsonl does not know, a vocabulary
file that is not SentencePiece; each named with its file, line and fix."""
import json

import pytest
import seqio

import decal_jax.tasks  # noqa: F401  (registers the tasks)
from decal_jax import fileio
from decal_jax.runtime import evaluation
from decal_jax.data import convert, hf_vocabularies, local_files, seqio_vocabularies, vocabularies
from decal_jax import text_metrics


from bad_input_helpers import _load_tool, _files_under, _write, _examples


# ---------------------------------------------------------------- data files
NOT_UTF8 = b'{"question": "Who?", "context": "caf\xe9 cr\xe8me", "answers": ["Ada"]}\n'
GOOD_QA = (json.dumps({"question": "Who wrote it?", "context": "Ada wrote it.",
                       "answers": ["Ada"]}) + "\n").encode()








QA_LENGTHS = {"inputs": 64, "targets": 16}


def test_a_non_utf8_line_in_a_downstream_jsonl_names_file_line_and_fix(local_data):
  data = GOOD_QA + NOT_UTF8
  path = _write(local_data / "squad" / "validation.jsonl", data)
  with pytest.raises(local_files.BadRecordError) as err:
    _examples("decal_squad", QA_LENGTHS)
  message = str(err.value)
  assert f"{path}:2: not UTF-8" in message and "re-save the file as UTF-8" in message
  assert "DECAL_BAD_LINES=skip" in message
  assert path.read_bytes() == data


def test_a_non_utf8_line_in_a_downstream_jsonl_is_skipped_on_request(local_data, monkeypatch,
                                                                     caplog):
  _write(local_data / "squad" / "validation.jsonl", NOT_UTF8 + GOOD_QA)
  monkeypatch.setenv("DECAL_BAD_LINES", "skip")
  examples = _examples("decal_squad", QA_LENGTHS)
  assert [e["targets_pretokenized"] for e in examples] == [b"Ada"]
  assert "skipped 1 bad line(s) of 2" in caplog.text


def test_a_non_utf8_line_in_a_text_lm_file_names_file_and_line(local_data, monkeypatch):
  data = b"A first line.\n\nA second \xff line.\n"
  path = _write(local_data / "text_lm" / "validation.txt", data)
  with pytest.raises(local_files.BadRecordError, match=f"{path}:3: not UTF-8"):
    _examples("decal_text_lm", {"targets": 8})
  monkeypatch.setenv("DECAL_BAD_LINES", "skip")
  tokens = [t for e in _examples("decal_text_lm", {"targets": 8}) for t in e["targets"]]
  expected = vocabularies.builtin_vocabulary().encode("A first line.")
  assert tokens == list(expected)  # only the good line is read
  assert path.read_bytes() == data


def test_a_non_utf8_line_in_a_squid_qa_jsonl_names_file_and_line(tmp_path, local_data):
  from decal_jax.tasks import squid_tasks
  path = _write(tmp_path / "mine.jsonl", GOOD_QA + GOOD_QA + NOT_UTF8)
  squid_tasks.register_squid_qa_jsonl_task("bad_inputs_squid_qa", {"validation": str(path)})
  try:
    with pytest.raises(local_files.BadRecordError, match=f"{path}:3: not UTF-8"):
      seqio.get_mixture_or_task("bad_inputs_squid_qa").source.num_input_examples("validation")
  finally:
    seqio.TaskRegistry.remove("bad_inputs_squid_qa")


def test_a_non_utf8_line_in_eval_inputs_names_file_and_line(tmp_path):
  path = _write(tmp_path / "inputs.jsonl", b'{"inputs": "fine"}\n{"inputs": "\xc3("}\n')
  with pytest.raises(local_files.BadRecordError, match=f"{path}:2: not UTF-8"):
    evaluation.read_inputs(str(path))


def test_a_non_utf8_line_in_make_vocab_input_names_file_and_line(tmp_path):
  path = _write(tmp_path / "text.txt", b"one line\nbad \xfe line\n")
  output = tmp_path / "out.model"
  with pytest.raises(SystemExit) as err:
    _load_tool("make_vocab").main(["--input", str(path), "--output", str(output)])
  assert f"{path}:2: not UTF-8" in str(err.value) and "re-save" in str(err.value)
  assert _files_under(tmp_path) == ["text.txt"]


HOTPOT_OFFICIAL = [{"_id": "h1", "question": "Which is older?", "answer": "Oslo",
                    "supporting_facts": [["Oslo", 0]],
                    "context": [["Oslo", ["Oslo was founded ", "in 1040."]],
                                ["Bergen", ["Bergen in 1070."]]]}]
HOTPOT_HF = [{"id": "h1", "question": "Which is older?", "answer": "Oslo",
              "type": "comparison", "level": "easy",
              "supporting_facts": {"title": ["Oslo"], "sent_id": [0]},
              "context": {"title": ["Oslo", "Bergen"],
                          "sentences": [["Oslo was founded ", "in 1040."], ["Bergen in 1070."]]}}]
SQUAD_OFFICIAL = {"version": "1.1", "data": [{"title": "Ada", "paragraphs": [
    {"context": "Ada wrote it in 1843.",
     "qas": [{"id": "s1", "question": "When?", "answers": [{"text": "1843",
                                                             "answer_start": 16}]}]}]}]}
SQUAD_HF = [{"id": "s1", "title": "Ada", "context": "Ada wrote it in 1843.", "question": "When?",
             "answers": {"text": ["1843"], "answer_start": [16]}}]


def _prepare(args, out):
  _load_tool("prepare_jsonl").main(args + ["--out", str(out)])


def _jsonl(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("name,official,hf,split_args", [
    ("hotpotqa", HOTPOT_OFFICIAL, HOTPOT_HF, ["--split", "train"]),
    ("squad", SQUAD_OFFICIAL, SQUAD_HF, ["--split", "train"]),
])
def test_prepare_jsonl_reads_the_hugging_face_layout_as_the_official_one(
    tmp_path, name, official, hf, split_args):
  (tmp_path / "official.json").write_text(json.dumps(official))
  (tmp_path / "hf.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hf))  # to_json
  _prepare([name, str(tmp_path / "official.json")] + split_args, tmp_path / "a")
  _prepare([name, str(tmp_path / "hf.jsonl")] + split_args, tmp_path / "b")
  expected = _jsonl(tmp_path / "a" / name / "train.jsonl")
  assert _jsonl(tmp_path / "b" / name / "train.jsonl") == expected and len(expected) == 1
  if name == "hotpotqa":
    assert expected[0]["context"] == "Oslo: Oslo was founded in 1040.\nBergen: Bergen in 1070."


def test_prepare_jsonl_gives_hugging_face_hotpotqa_rows_without_ids_row_ids(tmp_path,
                                                                           capsys):
  """An HF export of hotpot_qa without its `id` column was refused as in no known layout."""
  rows = [{k: v for k, v in HOTPOT_HF[0].items() if k != "id"},
          dict({k: v for k, v in HOTPOT_HF[0].items() if k != "id"}, question="Which?")]
  source = tmp_path / "hf.jsonl"
  source.write_text("".join(json.dumps(r) + "\n" for r in rows))
  _prepare(["hotpotqa", str(source), "--split", "train"], tmp_path / "out")
  out = capsys.readouterr().out
  records = _jsonl(tmp_path / "out" / "hotpotqa" / "train.jsonl")
  assert [(r["id"], r["question"]) for r in records] == [("row-0", "Which is older?"),
                                                         ("row-1", "Which?")]
  assert out.count("Note: ") == 1
  assert (f"Note: {source}: 2 of 2 record(s) have no id (no `_id` / `id` field); gave each "
          "the id row-<n>, n its 0-based row number in the file") in out
  with_ids = tmp_path / "ids.jsonl"
  with_ids.write_text("".join(json.dumps(r) + "\n" for r in HOTPOT_HF))
  _prepare(["hotpotqa", str(with_ids), "--split", "train"], tmp_path / "ids")
  assert "Note:" not in capsys.readouterr().out


SQUAD_V2 = {"version": "v2.0", "data": [{"title": "Ada", "paragraphs": [
    {"context": "Ada wrote it in 1843.",
     "qas": [{"id": "a1", "question": "When?", "is_impossible": False,
              "answers": [{"text": "1843", "answer_start": 16}]},
             {"id": "u1", "question": "Who read it?", "is_impossible": True, "answers": [],
              "plausible_answers": [{"text": "Ada", "answer_start": 0}]},
             {"id": "a2", "question": "Who?", "is_impossible": False,
              "answers": [{"text": "Ada", "answer_start": 0}]}]}]}]}


def test_prepare_jsonl_names_squad_v2_unanswerable_questions_and_keeps_them_on_request(
    local_data, tmp_path, capsys):
  """SQuAD v2's unanswerable questions were left out as 'empty fields / no answer'; now
  named with their count, and --keep_unanswerable keeps them as empty-string targets."""
  source = _write(tmp_path / "dev-v2.0.json", json.dumps(SQUAD_V2).encode())
  release = source.read_bytes()
  _prepare(["squad", str(source), "--split", "validation"], tmp_path / "dropped")
  out = capsys.readouterr().out
  assert (f"Note: {source}: 1 of 3 question(s) are unanswerable (SQuAD v2: no answer); left "
          "out. --keep_unanswerable keeps them with the empty string as their target "
          "(answers [\"\"]).") in out
  assert [r["id"] for r in _jsonl(tmp_path / "dropped" / "squad" / "validation.jsonl")] == \
      ["a1", "a2"]
  _prepare(["squad", str(source), "--split", "validation", "--keep_unanswerable"], local_data)
  assert (f"Note: {source}: 1 of 3 question(s) are unanswerable (SQuAD v2: no answer); kept "
          "with the empty string as their target (answers [\"\"]).") in capsys.readouterr().out
  kept = _jsonl(local_data / "squad" / "validation.jsonl")
  assert [(r["id"], r["answers"]) for r in kept] == [("a1", ["1843"]), ("u1", [""]),
                                                    ("a2", ["Ada"])]
  # The QA task reads it: the unanswerable question's target is EOS alone, its reference "".
  examples = _examples("decal_squad", QA_LENGTHS)
  vocab = vocabularies.builtin_vocabulary()
  assert [list(e["targets"]) for e in examples] == [
      list(vocab.encode(a)) + [vocab.eos_id] for a in ("1843", "", "Ada")]
  assert [a.decode() for a in examples[1]["answers"]] == [""]
  assert text_metrics.squad([[""]], [""]) == {"em": 100.0, "f1": 100.0,
                                              "contains_answer": 100.0}
  # Hugging Face squad_v2 rows (an empty answers.text) convert the same.
  rows = [{"id": "u1", "title": "Ada", "context": "Ada wrote it in 1843.",
           "question": "Who read it?", "answers": {"text": [], "answer_start": []}}]
  hf = _write(tmp_path / "hf.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
  _prepare(["squad", str(hf), "--split", "train", "--keep_unanswerable"], tmp_path / "hf")
  assert _jsonl(tmp_path / "hf" / "squad" / "train.jsonl") == [kept[1]]
  # The flag is SQuAD's: refused for another format before anything is written.
  with pytest.raises(SystemExit):
    _prepare(["hotpotqa", str(source), "--split", "train", "--keep_unanswerable"],
             tmp_path / "h")
  assert "--keep_unanswerable is for squad" in capsys.readouterr().err
  assert not (tmp_path / "h").exists() and source.read_bytes() == release


def test_prepare_jsonl_reads_one_hugging_face_mediasum_split(tmp_path):
  rows = [{"id": "NPR-1", "program": "p", "summary": "Talk.", "utt": ["Hi.", "Hello."],
           "speaker": ["A", "B"]},
          {"id": "CNN-2", "document": "C: Yes.\nD: No.", "summary": "More."}]
  source = tmp_path / "validation.json"
  source.write_text("\n".join(json.dumps(r) for r in rows))
  _prepare(["mediasum", str(source), "--split", "validation"], tmp_path / "out")
  records = _jsonl(tmp_path / "out" / "mediasum" / "validation.jsonl")
  assert [r["document"] for r in records] == ["A: Hi.\nB: Hello.", "C: Yes.\nD: No."]


@pytest.mark.parametrize("name,records", [
    ("hotpotqa", HOTPOT_OFFICIAL + [{"id": "h2", "query": "Where?", "passages": []}]),
    ("squad", SQUAD_HF + [{"id": "s2", "question": "Q?", "context": "C.", "answers": ["A"]}]),
    ("mediasum", [{"id": "m1", "transcript": "..."}]),
])
def test_prepare_jsonl_names_the_first_record_in_no_known_layout(tmp_path, capsys, name,
                                                                 records):
  source = tmp_path / "release.json"
  source.write_text(json.dumps(records))
  with pytest.raises(SystemExit) as err:
    _prepare([name, str(source), "--split", "train"], tmp_path / "out")
  message = capsys.readouterr().err
  assert err.value.code == 2 and f"{source}: record {len(records)} " in message
  assert f"it has keys {sorted(records[-1])}" in message
  assert convert.LAYOUTS[name] in message and "Nothing was written" in message
  assert _files_under(tmp_path) == ["release.json"]  # no folder, no .tmp file


def test_prepare_jsonl_names_the_line_of_a_non_utf8_release(tmp_path, capsys):
  source = tmp_path / "release.json"
  data = json.dumps(SQUAD_OFFICIAL, indent=1).encode().replace(b"1843.", b"18\xe943.")
  source.write_bytes(data)
  with pytest.raises(SystemExit):
    _prepare(["squad", str(source), "--split", "train"], tmp_path / "out")
  line = data[:data.index(b"\xe9")].count(b"\n") + 1
  assert f"{source}:{line}: not UTF-8" in capsys.readouterr().err
  assert _files_under(tmp_path) == ["release.json"]


@pytest.mark.parametrize("make", [vocabularies.t5_vocabulary,
                                  hf_vocabularies.HfSentencePieceVocabulary])
@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": {}}', b""])
def test_a_vocabulary_file_that_is_not_sentencepiece_is_named(tmp_path, make, content):
  path = tmp_path / "tokenizer.model"
  path.write_bytes(content)
  with pytest.raises(seqio_vocabularies.NotSentencePieceError) as err:
    make(str(path)).encode("hello")
  message = str(err.value)
  assert message.startswith(f"{path} is not a SentencePiece model")
  assert ("DECAL_T5_VOCAB" if make is vocabularies.t5_vocabulary else "LLAMA_TOKENIZER") in message
  assert path.read_bytes() == content


def test_a_non_utf8_squid_context_file_is_named_before_the_model_loads(tmp_path):
  context = _write(tmp_path / "doc.txt", b"A context.\nWith a \x80 byte.\n")
  model_dir = tmp_path / "no_model_here"  # never read: the context is checked first
  with pytest.raises(fileio.NotUtf8Error, match=f"{context}:2: not UTF-8"):
    _load_tool("squid_answer").main(["--model_dir", str(model_dir), "--context_file",
                                     str(context), "--question", "What?"])
  assert _files_under(tmp_path) == ["doc.txt"]


def test_prepare_jsonl_names_the_line_of_a_release_that_is_not_json(tmp_path, capsys):
  source = tmp_path / "release.json"
  source.write_text('{"data": [\n  {"paragraphs": [}\n]}\n')
  with pytest.raises(SystemExit):
    _prepare(["squad", str(source), "--split", "train"], tmp_path / "out")
  assert f"{source}:2: not valid JSON" in capsys.readouterr().err
  assert _files_under(tmp_path) == ["release.json"]


# ---------------------------------------------------------------- issue 48: a JSON array
# given as plain-text LM data
PRETTY_ARRAY = (b'[\n  {\n    "text": "A first document."\n  },\n'
                b'  {\n    "text": "A second."\n  }\n]\n')
ONE_LINE_ARRAY = b'["A first document.", "A second."]\n'


@pytest.mark.parametrize("data,first", [
    (PRETTY_ARRAY, "'['"), (b"\n" + ONE_LINE_ARRAY, repr(ONE_LINE_ARRAY.decode().strip()))])
def test_a_json_array_given_as_plain_text_lm_data_is_refused_naming_it_and_the_format(
    local_data, data, first):
  """It trained on its brackets, braces and keys without a word."""
  path = _write(local_data / "text_lm" / "validation.txt", data)
  with pytest.raises(local_files.BadRecordError) as err:
    _examples("decal_text_lm", {"targets": 64})
  message = str(err.value)
  assert message.startswith(f"{path} is a JSON array (its first non-blank line is {first}), "
                            "not plain text: this task reads one document per line")
  assert f"jq -r '.[].text' {path} > {local_data / 'text_lm' / 'validation'}.txt" in message
  assert "jq -c '.[]'" in message and "register_text_autoencode_task" in message
  assert path.read_bytes() == data and _files_under(local_data) == ["text_lm",
                                                                    "text_lm/validation.txt"]


def test_text_that_merely_starts_with_a_bracket_is_read_as_text(local_data):
  for text in (b"[1] Introduction\nA line.\n", b"[1]\nA footnote.\n", b"[see below] Text.\n",
               b"[{not json\n"):
    path = _write(local_data / "text_lm" / "validation.txt", text)
    assert local_files.json_array_start(str(path)) is None
  assert len(_examples("decal_text_lm", {"targets": 64})) == 1
