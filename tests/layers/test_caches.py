"""layers/caches.py, step by step against plain-Python bookkeeping of what each cache keeps.

The networks' tests hold cached decoding to the full forward pass; these pin each cache's
own rule (where a token goes, what stays valid) on random keys with ragged rows.
"""
import jax
import jax.numpy as jnp
import numpy as np

from decal_jax.layers import caches

BATCH, KV_HEADS, HEAD_DIM = 2, 2, 3


def _token(rng):
  """Random keys and values of one token `[batch, 1, kv_heads, head_dim]`."""
  return (jnp.asarray(rng.randn(BATCH, 1, KV_HEADS, HEAD_DIM), jnp.float32),
          jnp.asarray(rng.randn(BATCH, 1, KV_HEADS, HEAD_DIM), jnp.float32))


def _run(module, variables, *args):
  return module.apply(variables, *args, mutable=["cache"])


def test_step_counter_hands_out_offsets_and_advances():
  counter = caches.StepCounter()
  variables = counter.init(jax.random.PRNGKey(0), BATCH, 0)
  for step in range(3):
    (offsets, index), variables = _run(counter, variables, BATCH)
    assert int(index) == step
    np.testing.assert_array_equal(offsets, np.full((BATCH, 1), step))


def test_kv_cache_writes_each_step_at_its_index_and_marks_the_filled_prefix():
  rng = np.random.RandomState(0)
  cache = caches.KVCache()
  dummy = jnp.zeros((BATCH, 4, KV_HEADS, HEAD_DIM))
  (keys, _, filled), variables = cache.init_with_output(jax.random.PRNGKey(0), dummy, dummy)
  assert filled is None and keys.shape[1] == 4  # creation pass: plain attention
  written = []
  for step in range(4):
    k, v = _token(rng)
    written.append(np.asarray(k[:, 0]))
    (keys, values, filled), variables = _run(cache, variables, k, v, jnp.int32(step))
    np.testing.assert_array_equal(np.asarray(keys[:, :step + 1]), np.stack(written, 1))
    np.testing.assert_array_equal(np.asarray(keys[:, step + 1:]), 0.0)
    np.testing.assert_array_equal(np.asarray(filled[0, 0, 0]), np.arange(4) <= step)


def test_kv_cache_prefill_writes_the_prompt_then_steps_after_it():
  rng = np.random.RandomState(1)
  cache = caches.KVCache(max_length=5)
  prompt = jnp.asarray(rng.randn(BATCH, 3, KV_HEADS, HEAD_DIM), jnp.float32)
  (_, _, filled), variables = cache.init_with_output(jax.random.PRNGKey(0), prompt, prompt,
                                                     None, True)
  assert filled is None
  k, v = _token(rng)
  (keys, values, filled), _ = _run(cache, variables, k, v, jnp.int32(3))
  np.testing.assert_array_equal(np.asarray(keys[:, :3]), np.asarray(prompt))
  np.testing.assert_array_equal(np.asarray(values[:, 3]), np.asarray(v[:, 0]))
  np.testing.assert_array_equal(np.asarray(filled[0, 0, 0]), [True] * 4 + [False])


def test_ring_cache_keeps_the_last_tokens_valid_from_the_split_point():
  rng = np.random.RandomState(2)
  ring = caches.RingCache(3, KV_HEADS, HEAD_DIM)
  variables = ring.init(jax.random.PRNGKey(0), BATCH)
  history = []
  for position in range(7):
    k, v = _token(rng)
    history.append(np.asarray(k[:, 0]))
    split = max(0, position - 1)  # reads [split, position]
    (keys, _, valid), variables = _run(ring, variables, BATCH, k, v, position, split)
    for slot in range(3):
      held = [p for p in range(position + 1) if p % 3 == slot]
      if held:
        np.testing.assert_array_equal(np.asarray(keys[:, slot]), history[held[-1]])
      want = bool(held) and split <= held[-1] <= position
      np.testing.assert_array_equal(np.asarray(valid[:, slot]), [want] * BATCH)


def test_append_cache_appends_per_row_only_what_is_kept():
  rng = np.random.RandomState(3)
  cache = caches.AppendCache(3, KV_HEADS, HEAD_DIM)
  variables = cache.init(jax.random.PRNGKey(0), BATCH)
  keep = np.array([[1, 0, 1, 1, 1], [0, 0, 1, 0, 0]], bool)  # row 0 overflows 3 slots
  kept = [[], []]  # (position, key) per row, the last slot overwritten when full
  for position in range(5):
    k, v = _token(rng)
    split = position  # kept tokens strictly before the current one are valid
    (keys, _, valid), variables = _run(cache, variables, BATCH, k, v, position, split,
                                       jnp.asarray(keep[:, position]))
    for row in range(BATCH):
      if keep[row, position]:
        entry = (position, np.asarray(k[row, 0]))
        kept[row] = kept[row] + [entry] if len(kept[row]) < 3 else kept[row][:2] + [entry]
      for slot, (pos, key) in enumerate(kept[row]):
        np.testing.assert_array_equal(np.asarray(keys[row, slot]), key)
        assert bool(valid[row, slot]) == (pos < split)
      assert not np.any(np.asarray(valid[row, len(kept[row]):]))


def test_sentence_cache_writes_at_each_rows_place():
  rng = np.random.RandomState(4)
  cache = caches.SentenceCache(4, KV_HEADS, HEAD_DIM)
  variables = cache.init(jax.random.PRNGKey(0), BATCH)
  places = np.array([[0, 1, 2, 0], [0, 1, 0, 1]])  # row 1 closes a sentence after place 1
  last = {}
  for step in range(4):
    k, v = _token(rng)
    place = jnp.asarray(places[:, step])
    (keys, _, valid), variables = _run(cache, variables, BATCH, k, v, place)
    for row in range(BATCH):
      last[row, places[row, step]] = np.asarray(k[row, 0])
      for slot in range(places[row, step] + 1):
        np.testing.assert_array_equal(np.asarray(keys[row, slot]), last[row, slot])
      np.testing.assert_array_equal(np.asarray(valid[row]), np.arange(4) <= places[row, step])


def test_segment_cache_pools_each_finished_segment():
  rng = np.random.RandomState(5)
  emb, ratio, slots = KV_HEADS * HEAD_DIM, 2, 3
  cache = caches.SegmentCache(ratio, slots, emb, KV_HEADS, HEAD_DIM)
  variables = cache.init(jax.random.PRNGKey(0), BATCH)

  def to_kv(states, positions):  # keys: the pooled state itself, values: its position
    keys = states.reshape(BATCH, 1, KV_HEADS, HEAD_DIM)
    return keys, jnp.broadcast_to(positions[..., None, None], keys.shape).astype(states.dtype)

  states = rng.randn(6, BATCH, emb).astype(np.float32)
  for position in range(6):
    x = jnp.asarray(states[position][:, None])  # [batch, 1, embed]
    (keys, values, valid), variables = _run(cache, variables, BATCH, x, position, position,
                                            to_kv)
    finished = (position + 1) // ratio
    for segment in range(finished):
      mean = states[segment * ratio:(segment + 1) * ratio].mean(0)  # [batch, embed]
      np.testing.assert_allclose(np.asarray(keys[:, segment]).reshape(BATCH, emb), mean,
                                 rtol=1e-6)
      np.testing.assert_array_equal(np.asarray(values[:, segment]), segment * ratio + 1)
    want = [(s + 1) * ratio <= position for s in range(slots)]
    np.testing.assert_array_equal(np.asarray(valid), [want] * BATCH)
