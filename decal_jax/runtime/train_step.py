"""The jitted train step (T5X's `trainer.train_with_lr`): gradients, the optimizer update
and the NaN / Inf guard. The training loop (`trainer.train`) and `bench_train` use it; kept
apart from the loop, which reads data, so timing a step needs neither seqio nor TensorFlow."""
import jax
import jax.numpy as jnp
import optax

from decal_jax.runtime import resilience
from decal_jax.models import BaseModel


def global_norm(tree) -> jax.Array:
  """The L2 norm of all leaves together (optax.global_norm's formula; that name and its
  successors are deprecated across the optax versions we support)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


def make_train_step(model: BaseModel, optimizer, partitioner, shardings):
  """(state, global batch, rng) -> (state, aux), jitted with the state donated.

  A step whose loss or gradient norm is NaN / Inf changes neither params nor optimizer
  state (only the step counter); its aux values read 0 and `aux['nonfinite']` is 1, for
  `resilience.NonFiniteGuard` to raise or skip."""
  def step_fn(state, batch, rng):
    dropout_rng = jax.random.fold_in(rng, state["step"])
    grad_fn = jax.value_and_grad(model.loss_fn, has_aux=True)
    (loss, aux), grads = grad_fn(state["params"], batch, dropout_rng)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    aux = dict(aux, loss=loss, grad_norm=global_norm(grads))
    finite = jnp.isfinite(aux["loss"]) & jnp.isfinite(aux["grad_norm"])

    def if_finite(new, old):
      return jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)

    aux = jax.tree_util.tree_map(lambda v: jnp.where(finite, v, jnp.zeros_like(v)), aux)
    aux["nonfinite"] = (~finite).astype(jnp.int32)
    return {"params": if_finite(params, state["params"]),
            "opt_state": if_finite(opt_state, state["opt_state"]),
            "step": state["step"] + 1}, aux

  jitted = jax.jit(step_fn, out_shardings=(shardings, partitioner.replicated()),
                   donate_argnums=(0,))

  def run(state, batch, rng):
    with partitioner.activate(), resilience.explain_out_of_memory(batch):
      return jitted(state, batch, rng)
  run.jitted = jitted  # for ahead-of-time lowering (tools/bench_train.py)
  return run
