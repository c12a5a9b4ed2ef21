"""Answers for the flags that shape the model: its size, attention, positions, norms and
activations, mixture of experts, multi-latent attention and multi-token prediction, precision
and the layer implementations (Megatron's argument groups "transformer configuration",
"network size", "moe", "mla", "experimental_attention_variant", "heterogeneous architecture",
"Transformer-Engine")."""

from __future__ import annotations

from megatron_zeppelin.megatron.coverage import checks
from megatron_zeppelin.megatron.coverage.answers import irrelevant, refused, supported

HOST_TP1 = "tests/host/test_pretrain_loop.py::test_tp1_on_two_emulated_nodes_trains_as_one_process"
HOST_TP2_SP = (
    "tests/host/test_pretrain_loop.py::test_tp2_with_sequence_parallelism_trains_as_one_process"
)
MOE_EP1 = "tests/host/test_moe.py::test_moe_with_ep1_trains_as_one_process"
MOE_EP2 = "tests/host/test_moe.py::test_moe_with_ep2_trains_as_one_process"
MODEL_BUILT = "tests/host/test_model_spec.py::test_zeppelin_builds_the_model_megatron_builds"
EQUIVALENCE = (
    "tests/test_megatron_equivalence.py::test_loss_and_gradients_match_the_single_process_reference"
)
ROTARY = "tests/test_rotary.py::test_matches_megatron_rope_on_one_document"
POSITIONS = "tests/test_batch.py::test_labels_stay_inside_documents_and_positions_are_per_document"

PER_TOKEN = (
    "reaches Megatron's own modules through its config and acts on each token alone, wherever "
    "Zeppelin puts it"
)
KERNEL = (
    "a kernel, fusion, overlap or memory choice for the same maths; Zeppelin leaves it to Megatron"
)
VARIANTS = (
    "tests/host/test_attention_variants.py::"
    "test_losses_and_parameter_counts_equal_megatrons_own_model"
)
WINDOW_LAYERS = (
    "tests/test_core_attention_variants.py::test_the_window_skips_the_layers_megatron_skips"
)
NO_ROPE_LAYERS = (
    "tests/test_core_attention_variants.py::test_no_rope_layers_follow_megatrons_pattern"
)
ONLY_WITH = "only read with {}, which is refused"
NOT_GPT = "not read by GPT models (another model family or program)"

SHAPE = [
    *supported("--num-layers", "the model Megatron builds", test=HOST_TP1),
    *supported("--hidden-size", "the model Megatron builds", test=HOST_TP1),
    *supported("--ffn-hidden-size", "the model Megatron builds", test=HOST_TP1),
    *supported(
        "--num-attention-heads", "heads split over TP ranks in core attention", test=HOST_TP2_SP
    ),
    *supported(
        "--group-query-attention", "K/V heads in the rings and the cost model", test=EQUIVALENCE
    ),
    *supported("--num-query-groups", "K/V heads in the rings and the cost model", test=EQUIVALENCE),
    *refused(
        "--kv-channels",
        "Zeppelin's cost model takes head dim = hidden size / heads",
        change="drop --kv-channels",
        check=checks.kv_channels,
    ),
    *supported(
        "--untie-embeddings-and-output-weights",
        "handed to GPTModel as Megatron's builder hands it",
        test=MODEL_BUILT,
    ),
    *supported(
        "--normalization",
        "built into the spec as Megatron's GPT builder builds it (spec.BUILDER_FIELDS)",
        test=MODEL_BUILT,
    ),
    *supported("--qk-layernorm", "built into the spec (spec.BUILDER_FIELDS)", test=MODEL_BUILT),
    *supported("--qk-l2-norm", "built into the spec (spec.BUILDER_FIELDS)", test=MODEL_BUILT),
    *supported(
        "--transformer-impl",
        "local or transformer_engine layers from Megatron's own spec builders (the "
        "TransformerEngine kind is not run on CPU)",
        test=MODEL_BUILT,
        check=checks.transformer_impl,
    ),
    *irrelevant(
        "--hidden-dropout --fp32-residual-connection --apply-residual-connection-post-layernorm "
        "--norm-epsilon --apply-layernorm-1p --disable-bias-linear --add-qkv-bias "
        "--glu-linear-offset --activation-func-clamp-value --attention-output-gate "
        "--openai-gelu --squared-relu --swiglu --quick-geglu --use-te-activation-func "
        "--mlp-chunks-for-training --init-method-std --embedding-init-method-std "
        "--init-model-with-meta-device --no-initialization --use-cpu-initialization "
        "--no-clone-scatter-output-in-embedding --onnx-safe",
        PER_TOKEN,
    ),
    *irrelevant(
        "--use-mup --mup-width-mult --mup-base-hidden-size --mup-embedding-mult "
        "--mup-output-mult --mup-base-head-dim --mup-attn-scale-power",
        "MuP scales initialization and outputs per token, and its attention scale reaches "
        "Zeppelin's core attention as Megatron's softmax_scale",
    ),
    *irrelevant(
        "--encoder-num-layers --decoder-num-layers --bert-no-binary-head --is-hybrid-model "
        "--mamba-state-dim --mamba-head-dim --mamba-num-groups --mamba-num-heads "
        "--disable-mamba-mem-eff-path --mrope-section",
        NOT_GPT,
    ),
]

ATTENTION = [
    *refused(
        "--attention-dropout",
        "Zeppelin's ring attention applies no attention dropout",
        change="set --attention-dropout 0 (Megatron's default is 0.1)",
    ),
    *supported(
        "--softmax-type",
        "attention sinks (learnable: Megatron's softmax_offset parameter; off-by-one) applied "
        "to the rings' merged result",
        test=VARIANTS,
    ),
    *supported(
        "--window-size",
        "a left window in document positions: ring blocks outside it compute nothing, blocks "
        "across its edge are masked",
        test=VARIANTS,
        check=checks.window_size,
    ),
    *supported(
        "--window-attn-skip-freq", "the layers Megatron gives the window", test=WINDOW_LAYERS
    ),
    *refused(
        "--qk-clip",
        "QK clipping reads the largest attention logits Megatron's core attention records; "
        "Zeppelin's does not record them",
        change="drop --qk-clip",
    ),
    *irrelevant("--qk-clip-alpha --qk-clip-threshold", ONLY_WITH.format("--qk-clip")),
    *irrelevant(
        "--attention-backend --flash-attention-version --apply-query-key-layer-scaling "
        "--disable-bf16-reduced-precision-matmul --batch-invariant-mode --deterministic-mode",
        "Zeppelin's core attention replaces Megatron's attention backends (--zeppelin-kernel "
        "picks its kernel, which keeps the softmax statistics in float32); the rest is the same "
        "maths",
    ),
    *refused(
        "--use-kitchen-attention",
        "Kitchen's attention would be one more core attention; Zeppelin's replaces it",
        change="drop --use-kitchen-attention",
    ),
    *irrelevant("--kitchen-attention-backend", ONLY_WITH.format("--use-kitchen-attention")),
    *refused(
        "--multi-latent-attention",
        "multi-latent attention rotates part of each head with its own (YaRN) positions inside "
        "MLASelfAttention, and its query/key and value head dims differ; Zeppelin's core "
        "attention applies per-document RoPE to whole heads of one size",
        change="drop --multi-latent-attention",
    ),
    *irrelevant(
        "--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim "
        "--rotary-scaling-factor --mscale --mscale-all-dim --cache-mla-latents "
        "--mla-down-proj-fusion",
        ONLY_WITH.format("--multi-latent-attention"),
    ),
    *refused(
        "--experimental-attention-variant",
        "Megatron's experimental attention layers (gated delta net, DSA) are not Zeppelin's "
        "core attention",
        change="drop --experimental-attention-variant",
    ),
    *irrelevant(
        "--linear-attention-freq --dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk "
        "--dsa-indexer-topk-freq --dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff "
        "--dsa-indexer-use-sparse-loss --dsa-kernel-backend --dsa-indexer-rope-interleaved "
        "--no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu "
        "--dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32 --linear-conv-kernel-dim "
        "--linear-key-head-dim --linear-value-head-dim --linear-num-key-heads "
        "--linear-num-value-heads",
        ONLY_WITH.format("--experimental-attention-variant"),
    ),
    *refused(
        "--heterogeneous-layers-config-path",
        "Megatron builds per-layer architectures from it; Zeppelin's spec builds uniform layers",
        change="drop --heterogeneous-layers-config-path",
    ),
    *refused(
        "--heterogeneous-layers-config-encoded-json",
        "Megatron builds per-layer architectures from it; Zeppelin's spec builds uniform layers",
        change="drop --heterogeneous-layers-config-encoded-json",
    ),
]

POSITIONS_ = [
    *supported(
        "--position-embedding-type",
        "rope per document inside core attention; learned_absolute and none read each token's "
        "position inside its document",
        test=HOST_TP1,
        check=checks.position_embedding,
    ),
    *supported("--max-position-embeddings", "handed to GPTModel", test=POSITIONS),
    *supported("--rotary-base", "Zeppelin's per-document RoPE", test=ROTARY),
    *supported("--rotary-percent", "Zeppelin's per-document RoPE", test=ROTARY),
    *supported("--rotary-interleaved", "Zeppelin's per-document RoPE", test=VARIANTS),
    *supported(
        "--rotary-seq-len-interpolation-factor", "Zeppelin's per-document RoPE", test=VARIANTS
    ),
    *supported(
        "--use-rope-scaling",
        "Llama 3.1 frequency scaling in Zeppelin's per-document RoPE",
        test=VARIANTS,
    ),
    *supported("--rope-scaling-factor", "Zeppelin's per-document RoPE", test=VARIANTS),
    *supported(
        "--no-rope-freq", "layers without rotary, as Megatron picks them", test=NO_ROPE_LAYERS
    ),
    *irrelevant(
        "--yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow "
        "--yarn-correction-range-round-to-int --no-yarn-correction-range-round-to-int "
        "--relative-attention-num-buckets "
        "--relative-attention-max-distance",
        "only read with --position-embedding-type yarn or relative, which are refused",
    ),
    *irrelevant(
        "--use-rotary-position-embeddings --no-position-embedding",
        "deprecated: Megatron turns the first into --position-embedding-type rope, and only "
        "its legacy models read the second",
    ),
]

MOE = [
    *supported("--num-experts", "Megatron's MoE layers in Zeppelin's spec", test=MOE_EP1),
    *supported("--moe-router-topk", "each token's experts, from that token alone", test=MOE_EP1),
    *supported("--moe-ffn-hidden-size", "Megatron's experts, priced per token", test=MOE_EP1),
    *supported("--moe-shared-expert-intermediate-size", "Megatron's shared experts", test=MOE_EP1),
    *supported("--moe-layer-freq", "Megatron's block spec puts the MoE layers", test=MODEL_BUILT),
    *supported(
        "--expert-model-parallel-size",
        "experts spread over ranks of Zeppelin's data-parallel world; tokens travel to them "
        "with the all-to-all dispatcher",
        test=MOE_EP2,
    ),
    *supported(
        "--moe-token-dispatcher-type",
        "alltoall (any expert parallelism) and allgather (expert parallelism 1) cope with "
        "token counts that differ per rank; flex is refused",
        test=MOE_EP2,
        check=checks.token_dispatcher,
    ),
    *supported(
        "--moe-router-load-balancing-type",
        "auxiliary-loss kinds at coefficient 0, or none; sinkhorn and quantile balancing "
        "balance over a rank's tokens and are refused",
        test=MOE_EP1,
        check=checks.load_balancing,
    ),
    *refused(
        "--moe-aux-loss-coeff",
        "Megatron's load-balancing loss multiplies two means over the tokens each rank holds, "
        "which Zeppelin's plan changes every micro-batch",
        change="set --moe-aux-loss-coeff 0",
        check=checks.aux_loss_coefficient,
    ),
    *refused(
        "--moe-z-loss-coeff",
        "the router z-loss is a mean over the tokens a rank holds, which Zeppelin changes every "
        "micro-batch",
        change="drop --moe-z-loss-coeff",
    ),
    *refused(
        "--moe-router-enable-expert-bias",
        "the expert bias follows token counts that include Zeppelin's padding rows",
        change="drop --moe-router-enable-expert-bias",
    ),
    *irrelevant(
        "--moe-router-bias-update-rate", ONLY_WITH.format("--moe-router-enable-expert-bias")
    ),
    *irrelevant(
        "--moe-router-quantile-balancing-ema",
        ONLY_WITH.format("--moe-router-load-balancing-type quantile_balancing"),
    ),
    *refused(
        "--moe-expert-capacity-factor",
        "which tokens an expert drops depends on which tokens a rank holds together, which "
        "Zeppelin's plan changes every micro-batch",
        change="train dropless: drop --moe-expert-capacity-factor",
    ),
    *irrelevant(
        "--moe-pad-expert-input-to-capacity --moe-token-drop-policy "
        "--moe-expert-rank-capacity-factor",
        ONLY_WITH.format("--moe-expert-capacity-factor"),
    ),
    *refused(
        "--moe-enable-deepep",
        "it selects the flex dispatcher, which is not tested with Zeppelin",
        change="use --moe-token-dispatcher-type alltoall",
    ),
    *irrelevant(
        "--moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep "
        "--moe-hybridep-pad-uneven-dispatch-inputs --moe-flex-dispatcher-num-sms "
        "--moe-deepep-num-sms --moe-hybridep-num-sms --moe-hybridep-num-blocks-permute "
        "--moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing "
        "--moe-ncclep-static-shape --moe-ncclep-zero-copy",
        ONLY_WITH.format("--moe-token-dispatcher-type flex"),
    ),
    *refused(
        "--overlap-moe-expert-parallel-comm",
        "it runs Megatron's combined 1F1B schedule, which asks forward_step for a schedule plan "
        "Zeppelin's forward_step does not build",
        change="drop --overlap-moe-expert-parallel-comm",
    ),
    *refused(
        "--moe-use-upcycling",
        "upcycling builds and loads a dense model through another path, not run with Zeppelin",
        change="drop --moe-use-upcycling",
    ),
    *irrelevant("--moe-upcycling-granularity", ONLY_WITH.format("--moe-use-upcycling")),
    *irrelevant(
        "--moe-router-pre-softmax --moe-router-score-function --moe-router-topk-scaling-factor "
        "--moe-router-num-groups --moe-router-group-topk --moe-router-dtype "
        "--moe-input-jitter-eps --moe-router-force-load-balancing --moe-router-force-biased "
        "--moe-apply-probs-on-input --moe-latent-size --moe-shared-expert-gate "
        "--moe-enable-routing-replay",
        "the router and experts act on each token alone (routing needs no other token), "
        "wherever Zeppelin puts it",
    ),
    *irrelevant(
        "--moe-grouped-gemm --moe-single-grouped-weight --moe-single-grouped-bias "
        "--use-grouped-gemm-for-shared-expert --use-grouped-gemm-for-dense-mlp "
        "--moe-mlp-glu-interleave-size --moe-shared-expert-glu-interleave-size "
        "--moe-permute-fusion --moe-router-fusion --moe-shared-expert-overlap "
        "--moe-router-padding-for-quantization --moe-router-padding-for-fp8 "
        "--moe-layer-recompute --moe-per-layer-logging --moe-pad-experts-for-cuda-graph-inference "
        "--moe-paged-stash --moe-paged-stash-page-size --moe-paged-stash-buffer-size-factor-cuda "
        "--moe-paged-stash-buffer-size-factor-cpu --delay-wgrad-compute "
        "--overlap-dispatch-backward-with-experts-wgrad --ep-overlap-early-attn-memory-release "
        "--high-priority-a2a-comm-stream",
        KERNEL,
    ),
]

MULTI_TOKEN_PREDICTION = [
    *refused(
        "--mtp-num-layers",
        "multi-token prediction shifts each packed row's tokens and labels by one per depth; "
        "in Zeppelin's linear layout a document's next token may sit on another rank",
        change="drop --mtp-num-layers",
    ),
    *irrelevant(
        "--mtp-loss-scaling-factor --mtp-use-repeated-layer --mtp-detach-heads "
        "--mtp-hybrid-override-pattern --mtp-standalone",
        ONLY_WITH.format("--mtp-num-layers"),
    ),
]

PRECISION = [
    *supported(
        "--bf16",
        "Zeppelin's kernels take bf16 and send gradients in float32; the cost model prices "
        "2-byte K/V",
        test="tests/test_train_cpu.py::test_bf16_trains_with_float32_main_weights_and_resumes_exactly",
    ),
    *supported(
        "--fp16",
        "Zeppelin's kernels take fp16 and accumulate in float32; the cost model prices 2-byte K/V",
        test="tests/test_kernels.py::test_low_precision_inputs_accumulate_in_float32",
    ),
    *refused(
        "--fp8-format",
        "TransformerEngine's FP8 GEMMs need row counts divisible by 16, and a Zeppelin rank's "
        "rows change every micro-batch",
        change="drop --fp8-format",
        dest="fp8",
    ),
    *refused(
        "--fp4-format",
        "TransformerEngine's FP4 GEMMs need fixed multiples of rows, and a Zeppelin rank's rows "
        "change every micro-batch",
        change="drop --fp4-format",
        dest="fp4",
    ),
    *refused(
        "--te-precision-config-file",
        "it sets TransformerEngine layers to FP8/FP4, which need fixed multiples of rows",
        change="drop --te-precision-config-file",
    ),
    *irrelevant(
        "--fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval --fp8-amax-history-len "
        "--fp8-amax-compute-algo --no-fp8-wgrad --fp8-output-proj --first-last-layers-bf16 "
        "--num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --fp4-recipe "
        "--fp4-quantizer-factory --fp8-param-gather --fp4-param-gather "
        "--keep-fp8-transpose-cache --reuse-grad-buf-for-mxfp8-param-ag",
        ONLY_WITH.format("--fp8-format or --fp4-format"),
    ),
]

LAYERS = [
    *irrelevant(
        "--use-fused-weighted-squared-relu --fused-residual-rmsnorm "
        "--use-transformer-engine-op-fuser --cross-entropy-loss-fusion "
        "--cross-entropy-fusion-impl --cpu-offloading-num-layers "
        "--cpu-offloading-retain-pinned-cpu-buffers --fine-grained-activation-offloading "
        "--offload-modules --min-offloaded-tensor-size --delay-offload-until-cuda-graph "
        "--delta-offload-bytes-across-pp-ranks --activation-offload-fraction "
        "--fine-grained-offloading-max-inflight-offloads --symmetric-ar-type "
        "--config-logger-dir",
        KERNEL,
    ),
    *supported(
        "--recompute-granularity",
        "full layers and selective modules (core attention included: its remaps and rings run "
        "again in the backward) recompute to the same gradients",
        test=MOE_EP2,
    ),
    *supported("--recompute-method", "which layers recompute (full granularity)", test=MOE_EP1),
    *supported(
        "--recompute-num-layers", "how many layers recompute (full granularity)", test=MOE_EP1
    ),
    *irrelevant("--recompute-modules", KERNEL),
    *refused(
        "--distribute-saved-activations",
        "it cuts each saved activation into equal chunks over the tensor-parallel ranks, and a "
        "Zeppelin rank's rows need not divide into them",
        change="drop --distribute-saved-activations",
    ),
    *refused(
        "--enable-cuda-graph",
        "CUDA graphs replay fixed shapes, and a Zeppelin rank's rows change every micro-batch",
        change="drop --enable-cuda-graph",
    ),
    *refused(
        "--external-cuda-graph",
        "CUDA graphs replay fixed shapes, and a Zeppelin rank's rows change every micro-batch",
        change="drop --external-cuda-graph",
    ),
    *refused(
        "--cuda-graph-impl",
        "CUDA graphs replay fixed shapes, and a Zeppelin rank's rows change every micro-batch",
        change="drop --cuda-graph-impl",
        allowed=("none",),
    ),
    *irrelevant(
        "--cuda-graph-warmup-steps --inference-cuda-graph-scope",
        ONLY_WITH.format("CUDA graphs"),
    ),
    *irrelevant(
        "--flash-decode --nccl-all-reduce-for-prefill --inference-fuse-tp-communication "
        "--inference-disable-triton-nvls-kernels --inference-grouped-gemm-backend "
        "--inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type "
        "--mlp-chunks-for-prefill",
        "inference only",
    ),
]

MODEL_ANSWERS = [
    *SHAPE,
    *ATTENTION,
    *POSITIONS_,
    *MOE,
    *MULTI_TOKEN_PREDICTION,
    *PRECISION,
    *LAYERS,
]
