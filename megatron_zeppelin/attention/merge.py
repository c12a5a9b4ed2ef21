"""Online-softmax merge of partial attention results (pure maths, no communication).

Attention of one query over a set of keys can be computed in pieces. Each piece (a block of
keys) yields a partial output ``o_i``, softmax-weighted over that block's keys only, and the
log-sum-exp ``lse_i`` of the block's scaled scores. The exact result over the union is

    lse = log(sum_i exp(lse_i))
    o   = sum_i exp(lse_i - lse) * o_i

Two pieces merge as ``o = lerp(o_a, o_b, w)`` with ``w = sigmoid(lse_b - lse_a)``, the share
of piece b (``exp(lse_b) / (exp(lse_a) + exp(lse_b))``), and ``lse = logaddexp(lse_a, lse_b)``:
five elementwise operators per merge, which the engine runs several times per layer (each one a
kernel the host launches). A piece in which the query sees no key at all (fully masked or
empty) has ``lse_i = -inf`` and weight zero; merging it changes nothing, and a query that saw no
key anywhere keeps ``o = 0, lse = -inf`` instead of turning into NaN (``-inf - -inf`` is NaN, a
share of 0). Partial outputs must be finite (kernels write zeros for rows without keys),
because ``0 * NaN`` would still be NaN.

Attention sinks (Megatron's ``--softmax-type off-by-one`` and ``learnable``) add one logit
``s_h`` per head to every row's softmax denominator, as one more key whose value is zero. It
joins the merged result like any other piece, with a zero output:

    lse' = log(exp(lse) + exp(s_h))        o' = exp(lse - lse') * o

(``add_sink_``). The backward needs nothing else: a kernel's gradient of one piece, given the
final ``o'`` and ``lse'``, uses the probabilities ``exp(score - lse')`` and the row term
``<do, o'>``, which are those of the softmax with the sink (the sink's value is zero, so it adds
nothing to ``<do, o'>``). The sink's own gradient is ``-sum over rows exp(s_h - lse') <do, o'>``
(``sink_gradient``). A row that saw no key keeps ``o = 0, lse = -inf`` and adds nothing: with
the sink its output would still be zero, and so would its share of the gradient.

Shapes: ``out`` is ``(..., d)`` and ``lse`` is ``(...)``, e.g. ``out_tnd`` ``(t, n, d)`` with
``lse_tn`` ``(t, n)``: t query rows, n heads, d head dim; a sink is ``sink_n`` ``(n)``. Merges
run in the dtype of their inputs; callers accumulate in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

__all__ = ["add_sink_", "as_dtype", "merge", "merge_rows", "merge_rows_", "sink_gradient"]


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call where ``x`` has it already: the engine casts every
    kernel part and every received row, mostly to the dtype they have, and a call that does
    nothing still costs the host more than the check."""
    return x if x.dtype == dtype else x.to(dtype)


def _share(lse_a: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Piece b's weight in the merge of a and b (0 where neither saw a key)."""
    return torch.nan_to_num(torch.sigmoid(lse_b - lse_a), nan=0.0)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    # A running maximum of -inf means "no key seen yet"; shifting by 0 keeps exp() at 0, not NaN.
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results of the same queries elementwise; returns ``(out, lse)``."""
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"cannot merge partial results of shapes {tuple(out_a.shape)} and "
            f"{tuple(out_b.shape)}: both pieces must cover the same query rows and heads"
        )
    share = _share(lse_a, lse_b).to(out_a.dtype).unsqueeze(-1)
    return torch.lerp(out_a, out_b.to(out_a.dtype), share), torch.logaddexp(lse_a, lse_b)


def merge_rows(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge pieces into the rows ``rows`` of a running result; returns new ``(out, lse)``.

    ``part_out[i]`` / ``part_lse[i]`` belong to row ``rows[i]``; a row may be named several times
    (several key blocks of one query in one call) and all of its pieces are merged at once.
    Rows not named keep their values.
    """
    if rows.dim() != 1 or rows.shape[0] != part_out.shape[0] or part_lse.shape[0] != rows.shape[0]:
        raise ValueError(
            f"rows ({tuple(rows.shape)}) must be a 1-D index with one entry per piece row "
            f"({part_out.shape[0]})"
        )
    index = rows.view(-1, *([1] * (lse.dim() - 1))).expand_as(part_lse)
    # The row-wise maximum over the old value and every piece keeps each exp() <= 1.
    peak = lse.scatter_reduce(0, index, part_lse, reduce="amax", include_self=True)
    shift = _finite_or_zero(peak)
    weight_old = torch.exp(lse - shift)
    weight_part = torch.exp(part_lse - shift[rows])
    total = weight_old.index_add(0, rows, weight_part)
    numer = (out * weight_old.unsqueeze(-1)).index_add(
        0, rows, part_out * weight_part.unsqueeze(-1)
    )
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    return numer / safe_total.unsqueeze(-1), shift + torch.log(total)


def merge_rows_(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: torch.Tensor | slice | None,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    *,
    unique: bool,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """In-place ``merge_rows`` that only touches the named rows.

    ``rows=None`` means the pieces cover every row in order, a ``slice`` a run of consecutive
    rows in order (merged in place through a view: no gather, no scatter). ``unique`` says
    whether an index tensor ``rows`` names each row at most once (the caller knows it from the
    layout); then the merge is a gather, an elementwise ``merge`` and a scatter. Otherwise the
    named rows are merged in a compact copy so the cost follows the piece size, not the size of
    ``out``; ``groups`` are the distinct rows and each piece row's place among them
    (``torch.unique(rows, return_inverse=True)``), worked out on the host when the layout is
    built: found here, on a GPU, they would make the host wait for the device.
    """
    if rows is None or isinstance(rows, slice):
        view_out, view_lse = (out, lse) if rows is None else (out[rows], lse[rows])
        if view_out.shape != part_out.shape or view_lse.shape != part_lse.shape:
            raise ValueError(
                f"cannot merge pieces of shape {tuple(part_out.shape)} into rows of shape "
                f"{tuple(view_out.shape)}: a piece must cover the rows it names"
            )
        # ``merge``'s arithmetic written into the running result: on a large buffer, fresh
        # full-size temporaries cost more than the maths.
        share = as_dtype(_share(view_lse, part_lse), view_out.dtype).unsqueeze(-1)
        view_out.lerp_(as_dtype(part_out, view_out.dtype), share)
        torch.logaddexp(view_lse, part_lse, out=view_lse)
        return
    if unique:
        new_out, new_lse = merge(out[rows], lse[rows], part_out, part_lse)
    else:
        touched, inverse = groups if groups is not None else torch.unique(rows, return_inverse=True)
        new_out, new_lse = merge_rows(out[touched], lse[touched], inverse, part_out, part_lse)
        rows = touched
    out.index_copy_(0, rows, as_dtype(new_out, out.dtype))
    lse.index_copy_(0, rows, as_dtype(new_lse, lse.dtype))


def add_sink_(out: torch.Tensor, lse: torch.Tensor, sink_n: torch.Tensor) -> None:
    """Add the per-head sink logits ``sink_n`` to the softmax of every row of a merged result,
    in place (see the module docstring); rows that saw no key stay as they are."""
    if sink_n.shape != lse.shape[-1:]:
        raise ValueError(
            f"a sink holds one logit per head: got {tuple(sink_n.shape)} for {lse.shape[-1]} heads"
        )
    sink = sink_n.to(lse.dtype).expand_as(lse)
    seen = torch.isfinite(lse)
    new_lse = torch.where(seen, torch.logaddexp(lse, sink), lse)
    out.mul_(torch.exp(torch.where(seen, lse - new_lse, 0.0)).unsqueeze(-1))
    lse.copy_(new_lse)


def sink_gradient(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink_n: torch.Tensor
) -> torch.Tensor:
    """Gradient of the loss in the sink logits, ``(n)`` in ``lse``'s dtype, from the rows' output
    gradient ``dout`` and their final (sink-included) ``out`` and ``lse``."""
    row_term = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # <do, o'> per row and head
    sink = sink_n.to(lse.dtype).expand_as(lse)
    weight = torch.where(torch.isfinite(lse), torch.exp(sink - lse), 0.0)
    return -(weight * row_term).reshape(-1, lse.shape[-1]).sum(0)
