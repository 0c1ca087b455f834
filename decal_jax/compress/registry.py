"""The compressors by name: what `T5Config.compressor` (a string, as gin binds it) may say.

    REGISTRY  name -> `Compressor` subclass; the built-in methods, one line each
    register(name, cls) / unregister(name)  add or remove one (plugins, tests)
    resolve(cfg)  a T5Config -> its compressor config (`T5Config.compression`; first called
                  when the T5Config is built, so a bad name fails there)

A new compressor is a `compress/base.Compressor` subclass in its own file plus one line
here (or a `register` call before the T5Config is built).
"""
import dataclasses
from typing import Dict, Tuple, Type

from decal_jax.compress.attn_pool import AttnPoolCompressor
from decal_jax.compress.base import Compressor, NoCompressor
from decal_jax.compress.latents import DecalCompressor
from decal_jax.compress.memory import MemoryCompressor

REGISTRY: Dict[str, Type[Compressor]] = {
    "latents": DecalCompressor,           # DeCAL (the default)
    "attn_pool": AttnPoolCompressor,      # AttnPool baseline
    "memory_tokens": MemoryCompressor,    # CCProxy baseline
}


def names() -> Tuple[str, ...]:
  """The registered names, in registration order."""
  return tuple(REGISTRY)


def register(name: str, cls: Type[Compressor]) -> Type[Compressor]:
  """Makes `T5Config.compressor = name` build `cls` (a `Compressor` subclass)."""
  if not (isinstance(cls, type) and issubclass(cls, Compressor)):
    raise TypeError(f"A compressor must be a Compressor subclass, got {cls!r}.")
  if REGISTRY.get(name, cls) is not cls:
    raise ValueError(f"Compressor name {name!r} is taken by {REGISTRY[name].__name__}; "
                     "unregister it first or choose another name.")
  REGISTRY[name] = cls
  return cls


def unregister(name: str) -> None:
  REGISTRY.pop(name, None)


def compressor_class(name: str) -> Type[Compressor]:
  if not isinstance(name, str) or name not in REGISTRY:
    raise ValueError(f"Unknown T5Config.compressor {name!r}; choose one of {names()} "
                     "(compress/registry.py).")
  return REGISTRY[name]


def _changed(value, default) -> bool:
  if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
    return tuple(value) != tuple(default)
  return value != default


def _check_exclusive_options(cfg, chosen: Type[Compressor]) -> None:
  """Options only another registered compressor reads must stay at their defaults."""
  defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
  for cls in dict.fromkeys(REGISTRY.values()):
    if cls is chosen:
      continue
    for name in cls.exclusive_options:
      if _changed(getattr(cfg, name), defaults[name]):
        raise ValueError(f"T5Config.{name} is a {cls.label} option but compressor is "
                         f"{cfg.compressor!r}; leave {name} at its default.")


def resolve(cfg) -> Compressor:
  """The compressor config of a `T5Config`: its named method built from the config's
  fields, or `NoCompressor` where that method does not compress (C = 1)."""
  cls = compressor_class(cfg.compressor)
  _check_exclusive_options(cfg, cls)
  compressor = cls.from_t5(cfg)
  return compressor if compressor.compresses else NoCompressor()
