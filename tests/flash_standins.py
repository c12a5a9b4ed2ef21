"""CPU stand-ins for flash-attn's Python interface, one per release's calling convention.

Not tests: ``test_kernel_adapters.py`` builds these and runs the package's adapters against them.
Each stand-in reproduces what of the real module an adapter can get wrong: the function names,
the order of the arguments and which are positional or keyword, the defaults, the shape of the
returned tuple, whether gradients are returned or written into the ``dq``/``dk``/``dv`` passed in,
the checks the real kernels make on their inputs (fp16/bf16 only, a contiguous last dim, int32
offsets, head dims that are multiples of 8, a float32 ``(nheads, total_q)`` log-sum-exp, an
output in the inputs' dtype) and, from flash-attn 2.7 and in FlashAttention-3 3.0.0, the
``torch.library.custom_op`` wrapping, built as a real custom op here so that its Python signature
is as opaque (``(*args, **kwargs)``) as the real one's. The maths is dense attention per packed
pair in float32 with flash-attn's bottom-right causal mask; the backward uses the output and
log-sum-exp it is given, as the real kernels do.

Sources (Dao-AILab/flash-attention):

* ``flash_attn_2_6``: tag v2.6.3, ``flash_attn/flash_attn_interface.py`` (v2.6.0 to v2.6.3 have
  the same varlen signatures);
* ``flash_attn_2_7(zero_tensors=False)``: tag v2.7.0, same file (v2.7.0 to v2.7.2);
* ``flash_attn_2_7(zero_tensors=True)``: tags v2.7.4.post1 and v2.8.3, same file (v2.7.3 to
  v2.8.3 share these signatures);
* ``flash_attn_3_beta``: tag v2.8.3, ``hopper/flash_attn_interface.py`` (``flash_attn_3``
  3.0.0b1, plain functions);
* ``flash_attn_3``: ``hopper/flash_attn_interface.py`` on the main branch in 2026
  (``flash_attn_3`` 3.0.0, custom ops).

``aten_flash_ops`` mimics ``torch.ops.aten._flash_attention_forward`` / ``_backward`` (schemas of
torch 2.13, printed by ``torch.ops.aten._flash_attention_forward.default._schema``).
"""

import importlib.machinery
import types

import torch

HALF = (torch.float16, torch.bfloat16)


# --- the maths and the real kernels' input checks ----------------------------------------------
def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> None:
    if q.dtype not in HALF or k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for x in (q, k, v):
        if x.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")
    if cu_q.dtype != torch.int32 or cu_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if q.shape[-1] % 8:
        raise RuntimeError("head_size should be a multiple of 8")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _pairs(cu_q: torch.Tensor, cu_k: torch.Tensor):  # noqa: ANN202
    for p in range(cu_q.shape[0] - 1):
        yield int(cu_q[p]), int(cu_q[p + 1]), int(cu_k[p]), int(cu_k[p + 1])


def _scores(q, k, q0, q1, k0, k1, scale, causal, window):  # noqa: ANN001, ANN202
    """Scaled scores of one pair with flash-attn's masks: causal, query i sees keys
    ``j <= i + lk - lq``; a ``(left, right)`` window (``-1``: unbounded; the causal flag bounds
    the right at 0), keys ``i + lk - lq - left <= j <= i + lk - lq + right``."""
    if not isinstance(window, tuple) or len(window) != 2:
        raise TypeError(f"window_size must be a (left, right) tuple of ints, got {window!r}")
    group = q.shape[1] // k.shape[1]
    qp = q[q0:q1].float()
    kp = k[k0:k1].float().repeat_interleave(group, 1)
    s = torch.einsum("qnd,knd->nqk", qp, kp) * scale
    lq, lk = q1 - q0, k1 - k0
    left, right = window
    right = 0 if causal else right
    everything = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        s = s.masked_fill(everything.triu(lk - lq + right + 1), float("-inf"))
    if left >= 0:
        s = s.masked_fill(everything.tril(lk - lq - left - 1), float("-inf"))
    return s


def dense_forward(q, k, v, cu_q, cu_k, scale, causal, window=(-1, -1)):  # noqa: ANN001, ANN201
    """``out`` (q's dtype) and ``lse`` ``(nheads, total_q)`` float32, as flash-attn returns."""
    _check(q, k, v, cu_q, cu_k)
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
    for q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        s = _scores(q, k, q0, q1, k0, k1, scale, causal, window)
        lse_p = s.logsumexp(-1)
        p = torch.exp(s - torch.where(lse_p.isinf(), 0.0, lse_p).unsqueeze(-1))
        vp = v[k0:k1].float().repeat_interleave(group, 1)
        out[q0:q1] = torch.einsum("nqk,knd->qnd", p, vp)
        lse[:, q0:q1] = lse_p
    return out.to(q.dtype), lse


def dense_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, window=(-1, -1)):  # noqa: ANN001, ANN201
    """``dq, dk, dv`` (q's dtype) from the GIVEN ``out`` and ``lse`` (flash-attn's contract)."""
    _check(q, k, v, cu_q, cu_k)
    if out.dtype != q.dtype:
        raise RuntimeError("out and q must have the same dtype")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"softmax_lse must be float32 (nheads, total_q), got {tuple(lse.shape)}")
    group = q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape)
    dk = torch.zeros(k.shape[0], q.shape[1], k.shape[2])
    dv = torch.zeros_like(dk)
    delta = (dout.float() * out.float()).sum(-1).t()  # (nheads, total_q)
    for q0, q1, k0, k1 in _pairs(cu_q, cu_k):
        s = _scores(q, k, q0, q1, k0, k1, scale, causal, window)
        p = torch.exp(s - lse[:, q0:q1].unsqueeze(-1))
        do = dout[q0:q1].float()
        kp = k[k0:k1].float().repeat_interleave(group, 1)
        vp = v[k0:k1].float().repeat_interleave(group, 1)
        dv[k0:k1] += torch.einsum("nqk,qnd->knd", p, do)
        ds = p * (torch.einsum("qnd,knd->nqk", do, vp) - delta[:, q0:q1].unsqueeze(-1)) * scale
        dq[q0:q1] += torch.einsum("nqk,knd->qnd", ds, kp)
        dk[k0:k1] += torch.einsum("nqk,qnd->knd", ds, q[q0:q1].float())
    fold = lambda x: x.view(x.shape[0], k.shape[1], group, x.shape[2]).sum(2)  # noqa: E731
    return dq.to(q.dtype), fold(dk).to(q.dtype), fold(dv).to(q.dtype)


def _write(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise RuntimeError(f"gradient buffer {tuple(dst.shape)} {dst.dtype} does not fit")
    dst.copy_(src)


def _module(name: str, version: str, **functions) -> types.ModuleType:  # noqa: ANN003
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__version__ = version
    for key, fn in functions.items():
        setattr(module, key, fn)
    return module


# --- flash-attn 2 -------------------------------------------------------------------------------
def _varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):  # noqa: ANN001, ANN202
    """``flash_attn_varlen_func`` of v2.6.3 to v2.8.3 (the same signature throughout)."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = dense_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal, window_size)
    return (out, lse, None) if return_attn_probs else out


def flash_attn_2_6() -> types.ModuleType:
    """v2.6.3: the private varlen backward is a plain function taking one ``window_size`` tuple
    and returning ``(dq, dk, dv, softmax_d)``."""

    def _flash_attn_varlen_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):  # noqa: ANN001, ANN202
        if not isinstance(window_size, tuple) or len(window_size) != 2:
            raise TypeError(f"window_size must be a (left, right) tuple, got {window_size!r}")
        grads = dense_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            softmax_scale,
            causal,
            window_size,
        )
        for dst, src in zip((dq, dk, dv), grads):
            _write(dst, src)
        return dq, dk, dv, torch.zeros(q.shape[1], q.shape[0])

    return _module(
        "flash_attn.flash_attn_interface",
        "2.6.3",
        flash_attn_varlen_func=_varlen_func,
        _flash_attn_varlen_backward=_flash_attn_varlen_backward,
    )


_BUILT: dict[str, object] = {}


def flash_attn_2_7(*, zero_tensors: bool) -> types.ModuleType:
    """v2.7.0 (``zero_tensors=False``) or v2.7.4.post1 / v2.8.3 (``True``): the private varlen
    backward is a ``torch.library.custom_op`` mutating ``dq``, ``dk``, ``dv``, taking
    ``window_size_left``/``_right`` and returning ``softmax_d`` only."""
    key = f"fa27_{int(zero_tensors)}"
    if key not in _BUILT:

        def impl(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            alibi_slopes,
            deterministic,
            rng_state=None,
            zero_tensors=False,
        ):  # noqa: ANN001, ANN202
            grads = dense_backward(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                cu_seqlens_q,
                cu_seqlens_k,
                softmax_scale,
                causal,
                (window_size_left, window_size_right),
            )
            for dst, src in zip((dq, dk, dv), grads):
                _write(dst, src)
            return torch.zeros(q.shape[1], q.shape[0])

        def typed(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            softmax_lse: torch.Tensor,
            dq: torch.Tensor | None,
            dk: torch.Tensor | None,
            dv: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor,
            max_seqlen_q: int,
            max_seqlen_k: int,
            dropout_p: float,
            softmax_scale: float,
            causal: bool,
            window_size_left: int,
            window_size_right: int,
            softcap: float,
            alibi_slopes: torch.Tensor | None,
            deterministic: bool,
            rng_state: torch.Tensor | None = None,
        ) -> torch.Tensor:
            return impl(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                dq,
                dk,
                dv,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p,
                softmax_scale,
                causal,
                window_size_left,
                window_size_right,
                softcap,
                alibi_slopes,
                deterministic,
                rng_state,
            )

        def typed_zero(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            softmax_lse: torch.Tensor,
            dq: torch.Tensor | None,
            dk: torch.Tensor | None,
            dv: torch.Tensor | None,
            cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor,
            max_seqlen_q: int,
            max_seqlen_k: int,
            dropout_p: float,
            softmax_scale: float,
            causal: bool,
            window_size_left: int,
            window_size_right: int,
            softcap: float,
            alibi_slopes: torch.Tensor | None,
            deterministic: bool,
            rng_state: torch.Tensor | None = None,
            zero_tensors: bool = False,
        ) -> torch.Tensor:
            return impl(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                dq,
                dk,
                dv,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p,
                softmax_scale,
                causal,
                window_size_left,
                window_size_right,
                softcap,
                alibi_slopes,
                deterministic,
                rng_state,
                zero_tensors,
            )

        name = f"zeppelin_standin_{key}::_flash_attn_varlen_backward"
        fn = typed_zero if zero_tensors else typed
        _BUILT[key] = torch.library.custom_op(name, fn, mutates_args=("dq", "dk", "dv"))
    version = "2.8.3" if zero_tensors else "2.7.0"
    return _module(
        "flash_attn.flash_attn_interface",
        version,
        flash_attn_varlen_func=_varlen_func,
        _flash_attn_varlen_backward=_BUILT[key],
    )


def flash_attn_package(interface: types.ModuleType) -> types.ModuleType:
    """The ``flash_attn`` package around an interface stand-in (for ``sys.modules``)."""
    package = _module(
        "flash_attn",
        interface.__version__,
        flash_attn_interface=interface,
        flash_attn_varlen_func=interface.flash_attn_varlen_func,
    )
    package.__path__ = []
    return package


# --- FlashAttention-3 ---------------------------------------------------------------------------
def _fa3_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window,
):  # noqa: ANN001, ANN202
    if any(
        x is not None
        for x in (
            k_new,
            v_new,
            qv,
            out,
            cu_seqlens_k_new,
            seqused_q,
            seqused_k,
            page_table,
            kv_batch_idx,
            leftpad_k,
        )
    ):
        raise RuntimeError("this stand-in covers plain varlen attention only")
    return dense_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window)


def flash_attn_3_beta() -> types.ModuleType:
    """``flash_attn_3`` 3.0.0b1 (hopper/ at v2.8.3): plain functions; ``_flash_attn_forward``
    has 25 leading arguments without defaults and returns ``(out, softmax_lse, *rest)``;
    ``_flash_attn_backward`` returns ``(dq, dk, dv, softmax_d)``."""

    def _flash_attn_forward(
        q,
        k,
        v,
        k_new,
        v_new,
        qv,
        out,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_k_new,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        page_table,
        kv_batch_idx,
        leftpad_k,
        rotary_cos,
        rotary_sin,
        seqlens_rotary,
        q_descale,
        k_descale,
        v_descale,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        rotary_interleaved=True,
        scheduler_metadata=None,
        num_splits=1,
        pack_gqa=None,
        sm_margin=0,
    ):  # noqa: ANN001, ANN202
        o, lse = _fa3_forward(
            q,
            k,
            v,
            k_new,
            v_new,
            qv,
            out,
            cu_seqlens_q,
            cu_seqlens_k,
            cu_seqlens_k_new,
            seqused_q,
            seqused_k,
            max_seqlen_q,
            max_seqlen_k,
            page_table,
            kv_batch_idx,
            leftpad_k,
            rotary_cos,
            rotary_sin,
            seqlens_rotary,
            q_descale,
            k_descale,
            v_descale,
            softmax_scale,
            causal,
            window_size,
        )
        return o, lse, None, None

    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        sequed_q,
        sequed_k,
        max_seqlen_q,
        max_seqlen_k,
        dq,
        dk,
        dv,
        softmax_scale,
        causal,
        window_size=(-1, -1),
        softcap=0.0,
        deterministic=False,
        sm_margin=0,
    ):  # noqa: ANN001, ANN202
        grads = dense_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            softmax_scale,
            causal,
            window_size,
        )
        for dst, src in zip((dq, dk, dv), grads):
            _write(dst, src)
        return dq, dk, dv, torch.zeros(q.shape[1], q.shape[0])

    return _module(
        "flash_attn_interface",
        "3.0.0b1",
        _flash_attn_forward=_flash_attn_forward,
        _flash_attn_backward=_flash_attn_backward,
    )


def flash_attn_3() -> types.ModuleType:
    """``flash_attn_3`` 3.0.0 (hopper/ on main, 2026): both private functions are custom ops
    with defaults after the first arguments; the backward returns ``softmax_d``."""
    if "fa3" not in _BUILT:

        def forward(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            k_new: torch.Tensor | None = None,
            v_new: torch.Tensor | None = None,
            qv: torch.Tensor | None = None,
            out_: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None,
            cu_seqlens_k_new: torch.Tensor | None = None,
            seqused_q: torch.Tensor | None = None,
            seqused_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None,
            page_table: torch.Tensor | None = None,
            kv_batch_idx: torch.Tensor | None = None,
            leftpad_k: torch.Tensor | None = None,
            rotary_cos: torch.Tensor | None = None,
            rotary_sin: torch.Tensor | None = None,
            seqlens_rotary: torch.Tensor | None = None,
            q_descale: torch.Tensor | None = None,
            k_descale: torch.Tensor | None = None,
            v_descale: torch.Tensor | None = None,
            softmax_scale: float | None = None,
            causal: bool = False,
            window_size_left: int = -1,
            window_size_right: int = -1,
            attention_chunk: int = 0,
            softcap: float = 0.0,
            rotary_interleaved: bool = True,
            scheduler_metadata: torch.Tensor | None = None,
            num_splits: int = 1,
            pack_gqa: bool | None = None,
            sm_margin: int = 0,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            o, lse = _fa3_forward(
                q,
                k,
                v,
                k_new,
                v_new,
                qv,
                out_,
                cu_seqlens_q,
                cu_seqlens_k,
                cu_seqlens_k_new,
                seqused_q,
                seqused_k,
                max_seqlen_q,
                max_seqlen_k,
                page_table,
                kv_batch_idx,
                leftpad_k,
                rotary_cos,
                rotary_sin,
                seqlens_rotary,
                q_descale,
                k_descale,
                v_descale,
                softmax_scale,
                causal,
                (window_size_left, window_size_right),
            )
            return o, lse, torch.empty(0), torch.empty(0)

        def backward(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            softmax_lse: torch.Tensor,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None,
            sequed_q: torch.Tensor | None = None,
            sequed_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None,
            dq: torch.Tensor | None = None,
            dk: torch.Tensor | None = None,
            dv: torch.Tensor | None = None,
            softmax_scale: float | None = None,
            is_causal: bool = False,
            window_size_left: int = -1,
            window_size_right: int = -1,
            softcap: float = 0.0,
            deterministic: bool = False,
            sm_margin: int = 0,
        ) -> torch.Tensor:
            grads = dense_backward(
                dout,
                q,
                k,
                v,
                out,
                softmax_lse,
                cu_seqlens_q,
                cu_seqlens_k,
                softmax_scale,
                is_causal,
                (window_size_left, window_size_right),
            )
            for dst, src in zip((dq, dk, dv), grads):
                _write(dst, src)
            return torch.zeros(q.shape[1], q.shape[0])

        _BUILT["fa3"] = (
            torch.library.custom_op(
                "zeppelin_standin_fa3::_flash_attn_forward", forward, mutates_args=()
            ),
            torch.library.custom_op(
                "zeppelin_standin_fa3::_flash_attn_backward",
                backward,
                mutates_args=("dq", "dk", "dv"),
            ),
        )
    fwd, bwd = _BUILT["fa3"]
    return _module(
        "flash_attn_interface", "3.0.0", _flash_attn_forward=fwd, _flash_attn_backward=bwd
    )


# --- PyTorch's operators ------------------------------------------------------------------------
def _unset(bound: int | None) -> int:
    """The operators' ``None`` window bound as flash-attn's ``-1`` (unbounded)."""
    return -1 if bound is None else int(bound)


def aten_flash_ops() -> types.SimpleNamespace:
    """``torch.ops.aten._flash_attention_forward`` / ``_backward`` as of torch 2.13 (schemas in
    ``kernel_aten.py``), computed on the CPU."""

    def _flash_attention_forward(
        query,
        key,
        value,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        return_debug_mask,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
        seqused_k=None,
        alibi_slopes=None,
        block_table=None,
        num_splits=None,
    ):  # noqa: ANN001, ANN202
        s = query.shape[-1] ** -0.5 if scale is None else scale
        window = (_unset(window_size_left), _unset(window_size_right))
        out, lse = dense_forward(query, key, value, cum_seq_q, cum_seq_k, s, is_causal, window)
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, rng, torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=out.dtype)

    def _flash_attention_backward(
        grad_out,
        query,
        key,
        value,
        out,
        logsumexp,
        cum_seq_q,
        cum_seq_k,
        max_q,
        max_k,
        dropout_p,
        is_causal,
        rng_state,
        unused,
        *,
        scale=None,
        window_size_left=None,
        window_size_right=None,
    ):  # noqa: ANN001, ANN202
        if not isinstance(rng_state, torch.Tensor) or not isinstance(unused, torch.Tensor):
            raise TypeError("rng_state and unused must be tensors")
        s = query.shape[-1] ** -0.5 if scale is None else scale
        window = (_unset(window_size_left), _unset(window_size_right))
        return dense_backward(
            grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, s, is_causal, window
        )

    return types.SimpleNamespace(
        _flash_attention_forward=_flash_attention_forward,
        _flash_attention_backward=_flash_attention_backward,
    )
