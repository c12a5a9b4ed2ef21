"""Kernel pairs: which query rows of a document see which key rows, cut into the kinds of pair
attention kernels take (pure; ``layout.py`` packs them into kernel calls).

Masks. Query and key rows carry absolute positions inside their document; causality means key
position <= query position. One query span ``[qs, qe)`` against one key span ``[ks, ke)`` is
fully visible when ``ke - 1 <= qs``, hidden when ``ks > qe - 1`` and cut by the diagonal
otherwise. Kernels (flash-attn's included) only offer "no mask" and "causal aligned to the
bottom-right corner" (query ``i`` of ``lq`` sees key ``j <= i + lk - lq``), so a diagonal span
pair is cut into rows that see no key (dropped), a bottom-right causal band, and rows below the
band that see every key (an unmasked pair). Neighbouring pairs are then joined where the joined
pair has the same mask. Under zigzag (rank ``i`` of ``g`` holds chunks ``i`` and ``2g-1-i``):

    compute 0, own block       causal  chunk i      x chunk i
                               causal  chunk 2g-1-i x (chunk i, chunk 2g-1-i)
    ring step, block j < i     full    (both chunks) x chunk j
    ring step, block j > i     full    chunk 2g-1-i  x (both chunks of j)

so compute 0 is one causal call and every ring step's compute one unmasked call, whatever the
number of documents. Plans that are not zigzag (any spans) work too, with more pairs.

Sliding window (``--window-size w,0``): query position ``p`` sees key positions ``p - w .. p``
of its document only, positions inside the document whichever rank holds them. A span pair then
falls into up to four pairs, each of a kind kernels take (``kernel_api.py``):

    queries inside the key span        causal, window w    the diagonal band; the keys start at
                                                            the first query's window (or the span)
    queries after the keys, whose      unmasked            every key visible
    window reaches back past the span
    queries whose window edge cuts     window 0, square    query i sees keys j >= i (the edge,
    the span                                                top-left aligned), plus an unmasked
                                                            pair for the keys after the square
    queries whose window ends before   nothing             (a whole ring block skipped)

A pair the window does not cut stays of its plain kind. Pairs with a window never join others:
a join is right in rows, and a window counts positions, which rows of two spans do not keep.
So a ring step computes up to four calls (one per kind) instead of one, and blocks outside the
band cost no compute. They still travel: the ring passes every block to every member.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Pair", "block_pairs"]


@dataclass(frozen=True)
class Pair:
    """Query rows ``[q_start, q_end)`` against key rows ``[k_start, k_end)``; ``causal``:
    bottom-right aligned mask, else unmasked; ``window``: the left window of the kernel call
    (``kernel_api.VarlenBatch.window``), ``None`` for none."""

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool
    window: int | None = None

    @property
    def kind(self) -> tuple[bool, int | None]:
        """The call this pair needs: its mask and window."""
        return self.causal, self.window


def _span_pairs(qs: int, qe: int, q_row: int, ks: int, ke: int, k_row: int) -> list[Pair]:
    """Kernel pairs for query positions ``[qs, qe)`` at ``q_row`` against keys ``[ks, ke)`` at
    ``k_row``. Key ``c`` (0-based in the span) is visible to query ``r`` iff ``c <= r + shift``."""
    lq, lk, shift = qe - qs, ke - ks, qs - ks
    # A one-key span at the query's own start (shift 0) stays a causal band: it then joins the
    # other diagonal blocks of a zigzag chunk pair instead of forcing an unmasked call.
    if shift >= lk - 1 and shift > 0:
        return [Pair(q_row, q_row + lq, k_row, k_row + lk, False)]
    if shift + lq - 1 < 0:
        return []
    first = max(0, -shift)  # first query that sees a key
    stop = min(lq, lk - shift)  # queries from here on see every key
    band = Pair(q_row + first, q_row + stop, k_row, k_row + stop + shift, True)
    pairs = [band]
    if stop < lq:
        pairs.append(Pair(q_row + stop, q_row + lq, k_row, k_row + lk, False))
    return pairs


def _window_pairs(
    qs: int, qe: int, q_row: int, ks: int, ke: int, k_row: int, window: int
) -> list[Pair]:
    """``_span_pairs`` with a left window of ``window`` positions (see the module docstring):
    query position ``p`` sees key positions ``max(ks, p - window) .. min(ke - 1, p)``."""

    def pair(a: int, b: int, c: int, d: int, causal: bool, w: int | None = None) -> Pair:
        """Query positions ``[a, b)`` against key positions ``[c, d)``, as rows."""
        return Pair(q_row + a - qs, q_row + b - qs, k_row + c - ks, k_row + d - ks, causal, w)

    pairs = []
    a, b = max(qs, ks), min(qe, ke)  # queries inside the key span: the diagonal band
    if a < b:
        first = max(ks, a - window)  # no query of the band sees a key before this one
        cut = b - 1 - window > first  # a later query's window starts after the first key
        pairs.append(pair(a, b, first, b, True, window if cut else None))
    c, d = max(qs, ke), min(qe, ke + window)  # queries after the span that still reach it
    edge = min(d, max(c, ks + window + 1))  # from here on the window's edge cuts the span
    if c < edge:
        pairs.append(pair(c, edge, ks, ke, False))
    if edge < d:
        # Query edge + i sees key positions from edge + i - window: a square whose query i
        # sees its keys j >= i, then the keys after it, which every one of these queries sees.
        square = d - edge > 1
        pairs.append(pair(edge, d, edge - window, d - window, False, 0 if square else None))
        if d - window < ke:
            pairs.append(pair(edge, d, d - window, ke, False))
    return pairs


def _join(a: Pair, b: Pair) -> Pair | None:
    """``a`` and ``b`` as one pair with the same visibility, or ``None`` (always for pairs with
    a window: see the module docstring)."""
    if a.window is not None or b.window is not None:
        return None
    same_q = a.q_start == b.q_start and a.q_end == b.q_end
    if not a.causal and same_q and a.k_end == b.k_start:
        # Keys appended after fully visible keys: the mask of ``b`` extends unchanged, since a
        # causal pair always has at least as many keys as queries.
        return Pair(a.q_start, a.q_end, a.k_start, b.k_end, b.causal)
    if not a.causal and not b.causal and a.q_end == b.q_start:
        if (a.k_start, a.k_end) == (b.k_start, b.k_end):
            return Pair(a.q_start, b.q_end, a.k_start, a.k_end, False)
    if a.causal and b.causal and a.q_end == b.q_start and a.k_start == b.k_start:
        # Stacked causal bands share a diagonal when b's keys extend a's by b's query count.
        if b.k_end - a.k_end == b.q_end - b.q_start:
            return Pair(a.q_start, b.q_end, a.k_start, b.k_end, True)
    return None


def block_pairs(
    q_spans: list[tuple[int, int, int]],
    k_spans: list[tuple[int, int, int]],
    window: int | None = None,
) -> list[Pair]:
    """Kernel pairs for one document: query spans ``(start, end, row)`` against key spans,
    every query seeing the ``window`` key positions before its own (``None``: all of them)."""
    if window is None:
        pairs = [p for q in q_spans for k in k_spans for p in _span_pairs(*q, *k)]
    else:
        pairs = [p for q in q_spans for k in k_spans for p in _window_pairs(*q, *k, window)]
    joined = True
    while joined and len(pairs) > 1:
        joined = False
        for i, a in enumerate(pairs):
            for j, b in enumerate(pairs):
                both = _join(a, b) if i != j else None
                if both is not None:
                    pairs = [p for n, p in enumerate(pairs) if n not in (i, j)] + [both]
                    joined = True
                    break
            if joined:
                break
    return sorted(pairs, key=lambda p: (p.q_start, p.k_start))
