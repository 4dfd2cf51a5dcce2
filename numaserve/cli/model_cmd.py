"""`numaserve model init PATH --size 2GB` / `numaserve model check PATH`: the reference model's weights.

``init`` writes a safetensors file of seeded random weights (the same seed and
options give the same bytes), streamed to disk; ``check`` loads a file the way
the preload hook does and says what it holds or, in one line, what is wrong.
"""

from __future__ import annotations

import os
import sys
import time

import click

from numaserve.errors import NumaserveError, UsageError


@click.group("model")
def model() -> None:
    """The reference model app's weights (numaserve.apps.model)."""


@model.command("init")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--size", default="2GB", show_default=True, help="Weight bytes to aim for (e.g. 32MB, 1GB, 2GiB).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**63 - 1), help="Random seed.")
@click.option("--layers", default=8, show_default=True, type=click.IntRange(1, 256), help="Transformer layers.")
@click.option("--heads", default=8, show_default=True, type=click.IntRange(1, 256), help="Attention heads.")
@click.option("--words", default=8000, show_default=True, type=click.IntRange(1, 1_000_000),
              help="Word tokens (after the 256 byte tokens).")
@click.option("--ctx", default=1024, show_default=True, type=click.IntRange(8, 1 << 16),
              help="Longest sequence (prompt + generated tokens).")
@click.option("--force", is_flag=True, help="Replace PATH if it exists.")
def init(path: str, size: str, seed: int, layers: int, heads: int, words: int, ctx: int, force: bool) -> None:
    """Write seeded weights to PATH (deterministic: same options, same file)."""
    from numaserve.apps.model.shape import SizeError, parse_size, shape_for_size
    from numaserve.apps.model.weights import WeightsError, init_weights

    try:
        shape = shape_for_size(parse_size(size), layers=layers, heads=heads, words=words, ctx=ctx)
    except SizeError as e:
        raise UsageError(f"--size: {e}") from e
    if os.path.exists(path) and not force:
        raise UsageError(f"{path} exists (use --force to replace it)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{path}: directory {parent} does not exist")
    tty = sys.stderr.isatty()

    def progress(fraction: float, name: str) -> None:
        if tty:
            click.echo(f"\r  {fraction * 100:5.1f}%  {name:<24}", nl=False, err=True)

    t0 = time.monotonic()
    try:
        written = init_weights(path, shape, seed, progress)
    except WeightsError as e:
        raise NumaserveError(str(e)) from e
    if tty:
        click.echo("", err=True)
    click.echo(f"{path}: {written} bytes, d_model {shape.d_model}, {shape.n_layers} layers, {shape.n_heads} heads, "
               f"vocab {shape.vocab}, ctx {shape.ctx}, seed {seed} ({time.monotonic() - t0:.1f}s)")


@model.command("check")
@click.argument("path", type=click.Path(dir_okay=False))
def check(path: str) -> None:
    """Load PATH as the preload hook would (header, shapes, checksums); exit 1 with the reason if bad."""
    from numaserve.apps.model.weights import WeightsError, load_weights

    t0 = time.monotonic()
    try:
        w = load_weights(path)
    except WeightsError as e:
        raise NumaserveError(str(e)) from e
    s = w.shape
    click.echo(f"{path}: ok, {w.nbytes} bytes of weights, d_model {s.d_model}, {s.n_layers} layers, "
               f"{s.n_heads} heads, vocab {s.vocab}, ctx {s.ctx}, seed {w.seed} "
               f"(loaded and checked in {time.monotonic() - t0:.1f}s)")
