"""Property-based fuzzing (hypothesis) of every reader of user files: local JSONL / text task
sources, BEIR and MS MARCO folders, infer input files, prepare_jsonl's release formats and
gin binding strings.

For any bytes, and for near-valid files (valid lines with one field mutated, truncated,
re-encoded, with a BOM, NUL bytes, huge numbers, deep nesting, blank lines), each reader
gives a parsed result (whose texts are valid Unicode) or its own error naming the file
(and line), never another exception; a refused conversion writes nothing. Derandomized,
so CI runs the same examples every time; `@example`s keep the crashes fuzzing found."""
import contextlib
import json
import pathlib
import tempfile

import gin
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from decal_jax import fileio
from decal_jax.data import convert, local_files
from decal_jax.retrieval import beir, msmarco
from decal_jax.runtime import evaluation, gin_utils

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---------------------------------------------------------------- strategies
# JSON text past Python's limits or beside Unicode: each once found a crash.
NASTY_JSON = ["1" * 5000, "[" * 5000 + "]" * 5000, '{"a": ' * 3000 + "1" + "}" * 3000,
              '"\\ud800"', '"x\\udfff"', '"\\ud83d\\ude00"', "NaN", "-Infinity", "1e999",
              '"\\u0000"', '"\u2028 \x85"', "-0", "[]", "{}", '""', '" "', "null"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=3),
    max_leaves=6)
json_texts = st.sampled_from(NASTY_JSON) | json_values.map(json.dumps)


@st.composite
def mutated_jsonl(draw, records):
  """JSON Lines of `records` with one of them mutated: a field set to another JSON value
  (huge numbers, deep nesting, lone surrogates ...), dropped, or the line replaced."""
  lines = [json.dumps(r, ensure_ascii=draw(st.booleans())) for r in records]
  i = draw(st.integers(0, len(lines) - 1))
  keys = sorted(records[i])
  how = draw(st.sampled_from(["field", "drop", "line", "none"]))
  if how == "field" and keys:
    key = draw(st.sampled_from(keys))
    body = ", ".join(f"{json.dumps(k)}: {draw(json_texts) if k == key else json.dumps(v)}"
                     for k, v in records[i].items())
    lines[i] = "{" + body + "}"
  elif how == "drop" and keys:
    lines[i] = json.dumps({k: v for k, v in records[i].items()
                           if k != draw(st.sampled_from(keys))})
  elif how == "line":
    lines[i] = draw(json_texts | st.text(max_size=20))
  return draw(damaged("\n".join(lines) + "\n"))


@st.composite
def damaged(draw, text):
  """`text` as bytes, perhaps damaged: truncated, re-encoded, a BOM, NUL or stray bytes,
  blank lines, CRLF."""
  how = draw(st.sampled_from(["utf-8", "truncate", "utf-16", "latin-1", "bom", "nul", "bytes",
                              "blank", "crlf"]))
  if how in ("utf-16", "latin-1"):
    return text.encode(how, "replace")
  data = text.encode("utf-8", "surrogatepass")
  at = draw(st.integers(0, len(data)))
  if how == "truncate":
    return data[:at]
  if how == "bom":
    return b"\xef\xbb\xbf" + data
  if how in ("nul", "bytes"):
    extra = b"\x00" if how == "nul" else draw(st.binary(min_size=1, max_size=4))
    return data[:at] + extra + data[at:]
  if how == "blank":
    return b"\n \n\t\r\n" + data + b"\n\n"
  if how == "crlf":
    return data.replace(b"\n", b"\r\n")
  return data


def file_bytes(records):
  """Any bytes, or near-valid JSON Lines of `records`."""
  return st.binary(max_size=200) | mutated_jsonl(records)


def tsv_bytes(rows):
  """Any bytes, or near-valid lines of `rows` (tuples of columns) joined by tabs."""
  lines = ["\t".join(row) for row in rows]
  return st.binary(max_size=200) | st.builds(
      lambda i, text: "\n".join(lines[:i] + [text] + lines[i + 1:]),
      st.integers(0, len(lines) - 1),
      st.text(max_size=30) | st.sampled_from(["a\tb\tc\td", "q1\t0\tp1\t" + "9" * 5000,
                                               "q1\t0\tp1\t١", "\t\t", " \x00\t0\tp1\t1"])
  ).flatmap(damaged)


# ---------------------------------------------------------------- checks
def _text(value):
  """A parsed result's texts must be valid Unicode (what tokenizers and tf.string take)."""
  if isinstance(value, str):
    value.encode("utf-8")
  elif isinstance(value, (list, tuple)):
    for v in value:
      _text(v)
  elif isinstance(value, dict):
    for k, v in value.items():
      _text(k)
      _text(v)
  return value


@contextlib.contextmanager
def refused_naming(path, *errors):
  """Any exception must be one of `errors` (the reader's own) and name `path`."""
  try:
    yield
  except errors as e:
    assert str(path) in str(e), f"{type(e).__name__} does not name {path}: {e}"


def _folder():
  return tempfile.TemporaryDirectory(prefix="fuzz-")


# ---------------------------------------------------------------- local JSONL / text sources
QA = [{"question": "Who?", "context": "Ada wrote it.", "answers": ["Ada"]},
      {"question": "When?", "context": "In 1843.", "answers": ["1843", "then"]}]
QA_SCHEMA = local_files.Schema({"question": "text", "context": "text", "answers": "texts"})


@FUZZ
@given(data=file_bytes(QA), bad_lines=st.sampled_from(local_files.BAD_LINE_POLICIES))
@example(data=b'{"question": "q", "context": "c", "answers": ' + b"1" * 5000 + b"}\n",
         bad_lines="fail")
@example(data=b'{"question": "q", "context": "c", "answers": ' + b"[" * 5000 + b"}\n",
         bad_lines="fail")
@example(data=b'{"question": "\\ud800", "context": "c", "answers": ["a"]}\n', bad_lines="fail")
def test_fuzz_jsonl_source(data, bad_lines):
  with _folder() as folder:
    path = pathlib.Path(folder, "validation.jsonl")
    path.write_bytes(data)
    source = local_files.JsonlSource({"validation": str(path)}, QA_SCHEMA, bad_lines=bad_lines)
    with refused_naming(path, local_files.BadRecordError):
      records = list(source._records(source.checked("validation")))
      assert records and all(set(r) == set(QA_SCHEMA.kinds) for r in records)
      _text(records)


@FUZZ
@given(data=st.binary(max_size=200) | st.text(max_size=60).flatmap(damaged)
       | st.lists(json_texts, min_size=1, max_size=3).map("\n".join).flatmap(damaged))
@example(data=b'["x", {"y": ' + b"[" * 5000 + b"\n")
@example(data=b'[' + b"1" * 5000 + b', "a"]\n')
@example(data='["\xe9"]\n'.encode("utf-16-le"))
def test_fuzz_text_line_source(data):
  with _folder() as folder:
    path = pathlib.Path(folder, "validation.txt")
    path.write_bytes(data)
    source = local_files.TextLineSource({"validation": str(path)})
    with refused_naming(path, local_files.BadRecordError):
      records = list(source._records(source.checked("validation")))
      assert records and all(isinstance(r, str) and r.strip() for r in records)
      _text(records)


# ---------------------------------------------------------------- infer inputs
SUMMARIES = [{"document": "A long text.", "inputs": "Summarise this."},
             {"document": "Another.", "inputs": "And this."}]


@FUZZ
@given(data=file_bytes(SUMMARIES + QA), kind=st.sampled_from([None, "summarization", "qa"]))
@example(data=b'{"inputs": ' + b"1" * 5000 + b"}\n", kind=None)
@example(data=b'{"inputs": "\\udfff"}\n', kind=None)
@example(data=b'{"document": ["a", "\\ud800"]}\n', kind="summarization")
def test_fuzz_infer_inputs(data, kind):
  with _folder() as folder:
    path = pathlib.Path(folder, "inputs.jsonl")
    path.write_bytes(data)
    with refused_naming(path, local_files.BadRecordError, ValueError):
      texts = evaluation.read_inputs(str(path), "inputs", kind)
      assert texts and all(isinstance(t, str) and t.strip() for t in texts)
      _text(texts)


# ---------------------------------------------------------------- BEIR
CORPUS = [{"_id": "d1", "title": "T", "text": "first"}, {"_id": 2, "title": None, "text": "b"}]
QUERIES = [{"_id": "q1", "text": "what"}, {"_id": "q2", "text": "who"}]
QRELS = [("query-id", "corpus-id", "score"), ("q1", "d1", "1"), ("q2", "2", "0")]


def _beir_files(corpus, queries, qrels):
  return {"corpus.jsonl": corpus, "queries.jsonl": queries, "qrels/test.tsv": qrels}


def _valid(records):
  return "".join(json.dumps(r) + "\n" for r in records).encode()


VALID_QRELS = "".join("\t".join(r) + "\n" for r in QRELS).encode()


@FUZZ
@given(files=st.one_of(
    st.builds(_beir_files, file_bytes(CORPUS), st.just(_valid(QUERIES)), st.just(VALID_QRELS)),
    st.builds(_beir_files, st.just(_valid(CORPUS)), file_bytes(QUERIES), st.just(VALID_QRELS)),
    st.builds(_beir_files, st.just(_valid(CORPUS)), st.just(_valid(QUERIES)), tsv_bytes(QRELS))))
@example(files=_beir_files(b'{"_id": "d1", "text": "' + b"\\ud800" + b'"}\n', _valid(QUERIES),
                           VALID_QRELS))
@example(files=_beir_files(b'{"_id": "d1", "text": ' + b"9" * 5000 + b'}\n', _valid(QUERIES),
                           VALID_QRELS))
@example(files=_beir_files(_valid(CORPUS), b'{"_id": "q1", "text": ' + b"[" * 5000 + b"\n",
                           VALID_QRELS))
def test_fuzz_beir_folder(files):
  with _folder() as folder:
    for name, data in files.items():
      pathlib.Path(folder, name).parent.mkdir(exist_ok=True)
      pathlib.Path(folder, name).write_bytes(data)
    try:
      data = beir.load_beir(folder, "test")
    except beir.BadRetrievalFileError as e:
      assert any(str(pathlib.Path(folder, name)) in str(e) for name in files), str(e)
      return
    _text(([[k, p.title, p.text] for k, p in data.corpus.items()], data.queries,
           list(data.qrels)))
    json.dumps(data.corpus_fingerprint)


# ---------------------------------------------------------------- MS MARCO
COLLECTION = [("0", "first passage"), ("1", "second")]
QUERIES_TSV = [("10", "what"), ("11", "who")]
TREC = [("10", "0", "0", "1"), ("11", "0", "1", "0")]
TRIPLES = [("what", "first", "second"), ("10", "0", "1")]


@FUZZ
@given(kind=st.sampled_from(["collection", "queries", "qrels", "triples", "ids"]),
       data=st.data())
@example(kind="qrels", data=None)  # filled below: a grade past 4300 digits
def test_fuzz_msmarco_folder(kind, data):
  valid = {"collection": COLLECTION, "queries": QUERIES_TSV, "qrels": TREC,
           "triples": TRIPLES[:1], "ids": TRIPLES[1:]}
  text = {k: "".join("\t".join(r) + "\n" for r in rows).replace("\t", " " if k == "qrels"
                                                               else "\t")
          for k, rows in valid.items()}
  files = {k: v.encode() for k, v in text.items()}
  files[kind] = (data.draw(tsv_bytes(valid[kind])) if data is not None
                 else b"10 0 0 " + b"9" * 5000 + b"\n")
  names = {"collection": "collection.tsv", "queries": "queries.train.tsv",
           "qrels": "qrels.train.tsv", "triples": msmarco.TEXT_TRIPLES, "ids": msmarco.ID_TRIPLES}
  with _folder() as folder:
    for k in files if kind != "ids" else ("collection", "queries", "ids"):
      pathlib.Path(folder, names[k]).write_bytes(files[k])
    with refused_naming(pathlib.Path(folder), beir.BadRetrievalFileError):  # a file of it
      reader = msmarco.triples if kind in ("triples", "ids") else msmarco.pairs
      args = (folder,) if kind in ("triples", "ids") else (folder, "train")
      _text(list(reader(*args)))


# ---------------------------------------------------------------- prepare_jsonl's formats
SQUAD_ROWS = [{"id": "1", "question": "Who?", "context": "Ada.",
               "answers": {"text": ["Ada"], "answer_start": [0]}}]
SQUAD_OFFICIAL = {"data": [{"paragraphs": [{"context": "Ada.", "qas": [
    {"id": "1", "question": "Who?", "answers": [{"text": "Ada"}]}]}]}]}
HOTPOT = [{"_id": "h", "question": "Q?", "answer": "A",
           "context": [["T", ["One.", " Two."]]]},
          {"id": "g", "question": "Q?", "answer": "A",
           "context": {"title": ["T"], "sentences": [["One."]]}}]
MEDIASUM = [{"id": "m1", "summary": "S.", "utt": ["Hi."], "speaker": ["A"]},
            {"id": "m2", "document": ["x", "y"], "summary": "S."}]

RELEASES = st.one_of(
    st.tuples(st.just("squad"), file_bytes(SQUAD_ROWS)),
    st.tuples(st.just("squad"), mutated_jsonl([SQUAD_OFFICIAL])),
    st.tuples(st.just("hotpotqa"), file_bytes(HOTPOT)),
    st.tuples(st.just("mediasum"), file_bytes(MEDIASUM)),
    st.tuples(st.just("squad"), st.binary(max_size=100)))


@FUZZ
@given(release=RELEASES)
@example(release=("squad", b'{"data": [{"paragraphs": [{"context": "c", "qas": [["x"]]}]}]}'))
@example(release=("squad", b'{"id": "1", "question": "\\ud800", "context": "c", '
                           b'"answers": {"text": ["a"]}}'))
@example(release=("hotpotqa", b'[{"id": ' + b"1" * 5000 + b"}]"))
@example(release=("mediasum", b'[' * 5000 + b"\n"))
def test_fuzz_prepare_jsonl_formats(release):
  fmt, data = release
  with _folder() as folder:
    source = pathlib.Path(folder, "release.json")
    source.write_bytes(data)
    out = pathlib.Path(folder, "out")
    out.mkdir()
    (out / "validation.jsonl").write_text('{"kept": "as it was"}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    kind = "summarization" if fmt == "mediasum" else "qa"
    reader = convert.mediasum_split if fmt == "mediasum" else getattr(convert, fmt)
    try:
      convert.write(reader(str(source)), out / "validation.jsonl", kind)
    except (convert.ReleaseLayoutError, fileio.NotUtf8Error) as e:
      assert str(source) in str(e), str(e)
      assert {p.name: p.read_bytes() for p in out.iterdir()} == before
      return
    assert [p.name for p in out.iterdir()] == ["validation.jsonl"]  # no temp file left
    for line in (out / "validation.jsonl").read_text(encoding="utf-8").splitlines():
      assert convert.usable(json.loads(line), kind)


SPLITS = {"train": ["m1"], "val": ["m2"]}


@FUZZ
@given(dialogues=file_bytes(MEDIASUM), splits=file_bytes([SPLITS]))
@example(dialogues=_valid(MEDIASUM), splits=b'{"train": ["\\ud800"]}')
def test_fuzz_official_mediasum(dialogues, splits):
  with _folder() as folder:
    paths = [pathlib.Path(folder, "news_dialogue.json"), pathlib.Path(folder, "split.json")]
    paths[0].write_bytes(dialogues)
    paths[1].write_bytes(splits)
    out = pathlib.Path(folder, "out")
    try:
      convert.write_splits(convert.mediasum(*map(str, paths)), out, "summarization")
    except (convert.ReleaseLayoutError, fileio.NotUtf8Error) as e:
      assert any(str(p) in str(e) for p in paths), str(e)
      assert not out.exists()


# ---------------------------------------------------------------- gin binding strings
GIN_TOKENS = ["TRAIN_STEPS", "MODEL_DIR", "a.b", "scope/", "=", " ", "5", "'x'", '"', "'",
              "(", ")", "[", "]", "{", "}", ":", ",", "%", "@", "import", "include", "\n",
              "#", "\\", "gin.REQUIRED", "1e3", "-", "\x00", "é", "1" * 5000, "(" * 200]
gin_strings = (st.lists(st.sampled_from(GIN_TOKENS), max_size=8).map("".join)
               | st.text(max_size=20))
argv_items = st.one_of(
    gin_strings.map(lambda s: "--gin." + s), gin_strings.map(lambda s: "--gin_bindings=" + s),
    st.sampled_from(["--gin_bindings", "--gin_file", "--gin_search_paths", "--gin", "--gin_",
                     "--gin.", "-", "--", "--gin_file=", "-x", "--gin_b=5"]),
    gin_strings)


@FUZZ
@given(argv=st.lists(argv_items, max_size=4))
@example(argv=["--gin"])           # ambiguous: --gin_file, --gin_search_paths, --gin_bindings
@example(argv=["--gin_file"])      # no value
def test_fuzz_gin_command_line(argv):
  help_flags = ("-h", "--h", "--he", "--hel", "--help")
  if any(a.split("=")[0] in help_flags for a in argv):
    return  # prints the usage and exits 0, as asked
  try:
    files, paths, bindings = gin_utils.split_args(argv)
  except gin_utils.GinConfigError as e:
    assert str(e).startswith("error: ")
    return
  assert all(isinstance(x, str) for x in files + paths + bindings)
  with contextlib.suppress(gin_utils.GinConfigError):
    gin_utils.check_bindings([], [], bindings)


@pytest.fixture(scope="module")
def gin_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("gin") / "tiny.gin"
  path.write_text("TRAIN_STEPS = 5\nMODEL_DIR = '/tmp/m'\n")
  return str(path)


@FUZZ
@given(bindings=st.lists(gin_strings, max_size=3))
@example(bindings=["import no_such_module_anywhere"])
@example(bindings=["TRAIN_STEPS = " + "(" * 200 + "1" + ")" * 200])
def test_fuzz_gin_bindings(gin_file, bindings):
  try:
    gin_utils.parse([gin_file], [], bindings, register_tasks=False)
  except gin_utils.GinConfigError as e:
    assert str(e).startswith("error: ")
  finally:
    gin.clear_config()
