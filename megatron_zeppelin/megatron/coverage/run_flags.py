"""Answers for the flags that shape the run: parallelism, batches and steps, data and
tokenizer, initialization and precision of the gradients, and the entry points' options
(Megatron's argument groups "transformer configuration" (its parallel part), "training",
"RNG and initialization", "mixed precision", "distributed init", "validation", "data and
dataloader", "tokenizer", "experimental", "sft", "Logits Distillation")."""

from __future__ import annotations

from megatron_zeppelin.megatron.coverage import checks
from megatron_zeppelin.megatron.coverage.answers import irrelevant, refused, supported
from megatron_zeppelin.megatron.coverage.model_flags import (
    HOST_TP1,
    HOST_TP2_SP,
    KERNEL,
    MOE_EP2,
    NOT_GPT,
    ONLY_WITH,
    POSITIONS,
)

HOOKS = "tests/test_hooks.py::test_megatron_flags_the_hooks_cannot_honour_are_refused"
PIPELINE = "tests/host/test_pipeline.py::test_1f1b_stages_train_as_one_process"
INTERLEAVED = "tests/host/test_pipeline.py::test_interleaved_stages_resume_the_pipeline_checkpoint"
STAGE_LAYERS = (
    "tests/host/test_pipeline.py::test_a_stage_plans_with_the_layers_megatron_builds_on_it"
)
VALIDATION_LOSSES = (
    "tests/host/test_pretrain_loop.py::test_validation_and_test_losses_equal_the_one_process_values"
)
EVALUATION = "tests/test_evaluation.py::"
REFUSED_FLAGS = EVALUATION + "test_data_and_evaluation_flags_zeppelin_cannot_honour_are_refused"
BLEND = "tests/test_blend.py::"
DATA_FLAGS = BLEND + "test_every_form_of_megatrons_data_flags"
RESUME = (
    "tests/host/test_pretrain_loop.py::"
    "test_resuming_from_a_checkpoint_continues_the_uninterrupted_run"
)
GRADIENTS = (
    "acts on the gradients Megatron holds after the backward, which Zeppelin makes equal to "
    "one process's"
)
DATASET = "Megatron's dataset builder and loader; Zeppelin reads documents from --data-path itself"
TOKENIZER = (
    "Zeppelin reads token ids from the dataset; the tokenizer only gives Megatron the "
    "vocabulary size"
)
ONE_ROW = "one packed row per micro-batch: the document mask and positions are Zeppelin's own"

PARALLEL = [
    *supported("--tensor-model-parallel-size", "runs inside each Zeppelin rank", test=HOST_TP2_SP),
    *supported(
        "--sequence-parallel", "each rank's rows are padded to a multiple of TP", test=HOST_TP2_SP
    ),
    *refused(
        "--context-parallel-size",
        "Zeppelin replaces context parallelism and spreads long documents over the "
        "data-parallel ranks instead",
        change="set --context-parallel-size 1",
        allowed=(1,),
    ),
    *refused(
        "--hierarchical-context-parallel-sizes",
        "Zeppelin replaces context parallelism",
        change="drop --hierarchical-context-parallel-sizes",
    ),
    *refused(
        "--hybrid-context-parallel",
        "Zeppelin replaces context parallelism and packs documents itself",
        change="drop --hybrid-context-parallel",
    ),
    *refused(
        "--max-seqlen-per-dp-cp-rank",
        "Zeppelin replaces context parallelism and packs documents itself",
        change="drop --max-seqlen-per-dp-cp-rank (--zeppelin-capacity bounds a rank's tokens)",
    ),
    *irrelevant("--cp-comm-type", ONLY_WITH.format("--context-parallel-size above 1")),
    *supported(
        "--pipeline-model-parallel-size",
        "each stage's data-parallel group is a Zeppelin world planning the same plans; stages "
        "exchange their rows with Megatron's variable_seq_lengths (1F1B); a stage's GPUs fill "
        "whole nodes or share one",
        test=PIPELINE,
    ),
    *supported(
        "--num-layers-per-virtual-pipeline-stage",
        "Megatron's interleaved schedule: every model chunk runs every micro-batch's plan",
        test=INTERLEAVED,
    ),
    *supported(
        "--num-virtual-stages-per-pipeline-rank",
        "Megatron's interleaved schedule: every model chunk runs every micro-batch's plan",
        test=INTERLEAVED,
    ),
    *supported(
        "--decoder-first-pipeline-num-layers",
        "Megatron's own split of the layers; a stage's cost model counts the layers Megatron "
        "builds there",
        test=STAGE_LAYERS,
    ),
    *supported(
        "--decoder-last-pipeline-num-layers",
        "Megatron's own split of the layers; a stage's cost model counts the layers Megatron "
        "builds there",
        test=STAGE_LAYERS,
    ),
    *supported(
        "--account-for-embedding-in-pipeline-split",
        "Megatron's own split of the layers; a stage's cost model counts the layers Megatron "
        "builds there",
        test=STAGE_LAYERS,
    ),
    *supported(
        "--account-for-loss-in-pipeline-split",
        "Megatron's own split of the layers; a stage's cost model counts the layers Megatron "
        "builds there",
        test=STAGE_LAYERS,
    ),
    *supported(
        "--pipeline-model-parallel-layout",
        "Megatron's own split of the layers; a stage's cost model counts the layers Megatron "
        "builds there",
        test=STAGE_LAYERS,
    ),
    *irrelevant(
        "--pipeline-model-parallel-comm-backend --no-overlap-p2p-communication "
        "--overlap-p2p-communication-warmup-flush "
        "--microbatch-group-size-per-virtual-pipeline-stage --use-ring-exchange-p2p",
        "how Megatron's schedules send activations between stages and order the micro-batches; "
        "every model chunk takes the micro-batches in the order the schedule runs them "
        "(megatron/pipeline.py)",
    ),
    *irrelevant(
        "--expert-tensor-parallel-size",
        "how each expert's weights are split over GPUs; the all-to-all dispatcher moves "
        "tokens between the expert groups whatever their counts (all-gather: see "
        "--moe-token-dispatcher-type)",
    ),
    *refused(
        "--tensor-parallel-num-weight-shards",
        "sharding weights over more GPUs than tensor parallelism is not run with Zeppelin",
        change="drop --tensor-parallel-num-weight-shards",
        check=checks.weight_remat("--tensor-parallel-num-weight-shards", "gtp_weight_remat_size"),
    ),
    *refused(
        "--expert-tensor-parallel-num-weight-shards",
        "sharding expert weights over more GPUs than expert tensor parallelism is not run with "
        "Zeppelin",
        change="drop --expert-tensor-parallel-num-weight-shards",
        check=checks.weight_remat(
            "--expert-tensor-parallel-num-weight-shards", "expert_gtp_weight_remat_size"
        ),
    ),
    *refused(
        "--tp-comm-overlap",
        "TransformerEngine's userbuffers are sized for --seq-length rows, and a Zeppelin "
        "rank's rows change every micro-batch",
        change="drop --tp-comm-overlap",
    ),
    *irrelevant(
        "--no-tp-comm-bulk-wgrad --no-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag "
        "--no-tp-comm-overlap-rs --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag "
        "--no-tp-comm-split-rs --tp-comm-bootstrap-backend --tp-comm-overlap-cfg",
        ONLY_WITH.format("--tp-comm-overlap"),
    ),
    *irrelevant(
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit --overlap-grad-reduce "
        "--ddp-num-buckets --ddp-bucket-size --ddp-pad-buckets-for-high-nccl-busbw "
        "--ddp-reduce-scatter-with-fp32-accumulation "
        "--ddp-param-name-patterns-for-fp32-local-accumulation --ddp-average-in-collective "
        "--overlap-param-gather --overlap-param-gather-with-optimizer-step "
        "--no-align-param-gather --no-align-grad-reduce --use-distributed-optimizer "
        "--no-use-layer-wise-param-layout --use-nccl-ub --disable-symmetric-registration "
        "--fsdp-manual-registration --create-all-gather-group --data-parallel-sharding-strategy "
        "--outer-dp-sharding-strategy --no-gradient-reduce-div-fusion --fsdp-double-buffer "
        "--suggested-communication-unit-size --enable-full-sharding-in-hsdp "
        "--num-distributed-optimizer-instances --torch-fsdp2-no-reshard-after-forward "
        "--use-megatron-fsdp --use-torch-fsdp2 --grad-reduce-in-bf16 --loss-scale "
        "--initial-loss-scale --min-loss-scale --loss-scale-window --hysteresis "
        "--accumulate-allreduce-grads-in-fp32 --use-precision-aware-optimizer --main-grads-dtype "
        "--main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype "
        "--megatron-fsdp-main-params-dtype --megatron-fsdp-main-grads-dtype "
        "--megatron-fsdp-grad-comm-dtype --megatron-fsdp-enable-fine-grained-param-gather "
        "--megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail "
        "--optimizer --optimizer-cpu-offload --optimizer-cuda-graph --optimizer-offload-fraction "
        "--use-torch-optimizer-for-cpu-offload --overlap-cpu-optimizer-d2h-h2d "
        "--dump-param-to-param-group-map --no-pin-cpu-grads --no-pin-cpu-params "
        "--no-gradient-accumulation-fusion",
        GRADIENTS,
    ),
    *irrelevant(
        "--distributed-backend --distributed-timeout-minutes --local-rank --lazy-mpu-init "
        "--nccl-communicator-config-path --disable-gloo-process-groups --use-sharp "
        "--sharp-enabled-group --high-priority-stream-groups "
        "--distributed-timeout-seconds-after-init --flight-recorder-dump-path "
        "--flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout "
        "--flight-recorder-include-stack-trace --no-flight-recorder-include-only-active "
        "--no-flight-recorder-extra-dump-on-exec --disable-jit-fuser --model-parallel-size "
        "--fake-process-group",
        "process-group set-up and diagnostics; Zeppelin creates its own groups over the "
        "data-parallel ranks",
    ),
    *refused(
        "--use-tp-pp-dp-mapping",
        "with pipeline parallelism a stage's data-parallel ranks must be consecutive GPUs "
        "(Megatron's default order); without it both orders put the same ranks together",
        change="drop --use-tp-pp-dp-mapping",
        check=checks.rank_mapping,
    ),
]

TRAINING = [
    *supported(
        "--micro-batch-size",
        "must be 1: a micro-batch is one packed row of whole documents (args.py refuses others)",
        test="tests/host/test_entry_point.py::"
        "test_bad_flags_stop_the_entry_point_in_one_line_before_megatron_starts",
    ),
    *supported(
        "--global-batch-size",
        "a multiple of the data-parallel size; / DP micro-batches per step",
        test=HOST_TP1,
    ),
    *supported("--train-iters", "one step of documents per iteration", test=HOST_TP1),
    *supported("--seed", "weights, and the sampler's order of documents (resumable)", test=RESUME),
    *supported(
        "--calculate-per-token-loss",
        "switched on by Zeppelin: ranks hold different token counts",
        test=HOST_TP1,
    ),
    *refused(
        "--rampup-batch-size",
        "Zeppelin draws one optimizer step of documents at a time with a fixed number of "
        "micro-batches",
        change="drop --rampup-batch-size",
    ),
    *refused(
        "--step-batch-size-schedule",
        "Zeppelin draws one optimizer step of documents at a time with a fixed number of "
        "micro-batches",
        change="drop --step-batch-size-schedule",
    ),
    *refused(
        "--decrease-batch-size-if-needed",
        "Zeppelin draws one optimizer step of documents at a time with a fixed number of "
        "micro-batches",
        change="drop --decrease-batch-size-if-needed",
    ),
    *refused(
        "--iterations-to-skip",
        "Megatron skips those steps without a forward pass, so Zeppelin's sampler would not "
        "skip their documents",
        change="drop --iterations-to-skip",
    ),
    *irrelevant(
        "--train-samples",
        "Megatron counts iterations from it; Zeppelin draws one step of documents per iteration",
    ),
    *supported(
        "--recompute-activations",
        "selective recompute of core attention (its remaps and rings run again in the backward)",
        test=MOE_EP2,
    ),
    *supported(
        "--checkpoint-activations",
        "deprecated: full recompute of every layer",
        test=MOE_EP2,
    ),
    *irrelevant(
        "--no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-swiglu-fusion "
        "--no-bias-dropout-fusion --use-flash-attn --no-persist-layer-norm "
        "--empty-unused-memory-level",
        KERNEL,
    ),
    *irrelevant(
        "--no-rope-fusion",
        "Zeppelin switches Megatron's fused RoPE off itself: RoPE runs per document in its core "
        "attention",
    ),
    *refused(
        "--rope-type",
        "Zeppelin applies plain rotary positions per document",
        change="drop --rope-type",
        allowed=("rope",),
    ),
    *irrelevant(
        "--check-weight-hash-across-dp-replicas-interval --gpu-sniff-test-interval "
        "--train-sync-interval --exit-interval --exit-duration-in-mins --exit-signal-handler "
        "--exit-signal --exit-signal-handler-for-dataloader --exit-signal-handler-for-training "
        "--manual-gc --manual-gc-interval --no-manual-gc-eval "
        "--no-check-for-nan-in-loss-and-grad --check-for-large-grads "
        "--result-rejected-tracker-filename --use-mcore-models --batch-size "
        "--enable-experimental",
        "bookkeeping of Megatron's loop (the sampler's state is saved beside the checkpoints "
        "Megatron writes, docs/MEGATRON.md)",
    ),
    *irrelevant(
        "--te-rng-tracker --inference-rng-tracker --data-parallel-random-init "
        "--init-method-xavier-uniform",
        "initialization of the weights, before Zeppelin takes part",
    ),
    *irrelevant(
        "--attention-softmax-in-fp32",
        "Zeppelin's kernels keep the softmax statistics in float32 whatever the flag",
    ),
    *irrelevant(
        "--fp16-lm-cross-entropy",
        "handed to GPTModel as Megatron's builder hands it: the loss of each token",
    ),
    *irrelevant("--mamba-training-ssm-states-dtype", NOT_GPT),
]

VALIDATION = [
    *supported(
        "--eval-iters",
        "each evaluation iteration is one step of whole held-out documents, forward only "
        "through Zeppelin's path",
        test=VALIDATION_LOSSES,
    ),
    *supported(
        "--eval-interval",
        "must be given even with --eval-iters 0 (Megatron divides --train-iters by it)",
        test=HOOKS,
        check=checks.eval_interval,
    ),
    *supported(
        "--eval-global-batch-size",
        "a multiple of the data-parallel size; / DP micro-batches per evaluation iteration",
        test=EVALUATION + "test_per_split_datasets_and_the_evaluation_batch_size",
    ),
    *supported(
        "--eval-micro-batch-size",
        "must be 1, as --micro-batch-size",
        test=REFUSED_FLAGS,
        check=checks.eval_micro_batch_size,
    ),
    *supported(
        "--full-validation",
        "every evaluation passes over every validation document once",
        test=EVALUATION + "test_full_validation_passes_over_every_validation_document_each_time",
    ),
    *supported(
        "--skip-train",
        "evaluates validation and test from the start of each split",
        test=EVALUATION
        + "test_each_split_gets_its_markers_and_evaluation_reads_only_held_out_documents",
    ),
    *irrelevant(
        "--start-eval-at-iter",
        "when Megatron evaluates; Zeppelin's validation stream follows Megatron's count of "
        "consumed validation samples",
    ),
    *refused(
        "--multiple-validation-sets",
        "Zeppelin evaluates one validation set (the datasets of --valid-data-path are "
        "evaluated as one blend)",
        change="drop --multiple-validation-sets",
    ),
    *irrelevant("--validation-set-names", ONLY_WITH.format("--multiple-validation-sets")),
    *irrelevant("--test-mode", "a check of Megatron's own loop"),
]

DATA = [
    *supported(
        "--data-path",
        "PREFIX, PREFIX PREFIX ... or WEIGHT PREFIX ... of .bin/.idx datasets: a blend, drawn "
        "by tokens in proportion to the weights; files, token dtypes and weights checked at "
        "start-up",
        test=HOST_TP1,
    ),
    *supported(
        "--split",
        "Megatron's split (default 969, 30, 1), by documents: a run holds out the documents "
        "Megatron's own split holds out",
        test=BLEND + "test_held_out_documents_are_the_ones_megatrons_builder_holds_out",
    ),
    *supported("--data-args-path", "the --data-path list, read from a file", test=DATA_FLAGS),
    *supported(
        "--train-data-path",
        "a blend per split, each split every document of its datasets",
        test=DATA_FLAGS,
    ),
    *supported(
        "--valid-data-path",
        "a blend per split, each split every document of its datasets",
        test=DATA_FLAGS,
    ),
    *supported(
        "--test-data-path",
        "a blend per split, each split every document of its datasets",
        test=DATA_FLAGS,
    ),
    *supported(
        "--per-split-data-args-path", "the per-split blends, read from a file", test=DATA_FLAGS
    ),
    *supported(
        "--dataloader-type",
        "single or cyclic: Megatron's loaders only count micro-batches (external is refused)",
        test=REFUSED_FLAGS,
        check=checks.dataloader_type,
    ),
    *refused(
        "--phase-transition-iterations",
        "Zeppelin reads one dataset from --data-path, the same at every step",
        change="drop --phase-transition-iterations",
    ),
    *refused(
        "--mock-data",
        "Zeppelin reads documents from --data-path",
        change="write a synthetic dataset with zeppelin make-dataset and give --data-path",
    ),
    *refused(
        "--fim-data",
        "fill-in-the-middle rewrites Megatron's samples; Zeppelin's sampler reads the "
        "documents as they are",
        change="drop --fim-data",
    ),
    *irrelevant(
        "--fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix "
        "--fim-prefix-token --fim-middle-token --fim-suffix-token --fim-pad-token "
        "--fim-eod-token",
        ONLY_WITH.format("--fim-data"),
    ),
    *refused(
        "--sft",
        "supervised fine-tuning reads conversations with Megatron's SFT dataset and masks; "
        "Zeppelin's sampler reads pretraining documents",
        change="drop --sft",
    ),
    *irrelevant("--sft-tokenizer-prompt-format", ONLY_WITH.format("--sft")),
    *supported("--seq-length", "tokens per GPU of a micro-batch", test=HOST_TP1),
    *supported(
        "--reset-position-ids",
        "always on with Zeppelin: positions count from each document's start",
        test=POSITIONS,
    ),
    *supported(
        "--reset-attention-mask",
        "always on with Zeppelin: each document attends only to itself",
        test="tests/test_megatron_equivalence.py::"
        "test_loss_and_gradients_match_the_single_process_reference",
    ),
    *supported(
        "--dataloader-inter-document-masking",
        "always on with Zeppelin: each document attends only to itself",
        test="tests/test_megatron_equivalence.py::"
        "test_loss_and_gradients_match_the_single_process_reference",
    ),
    *supported(
        "--eod-mask-loss",
        "always on with Zeppelin: no label crosses a document's end (its last token has loss "
        "mask 0)",
        test=POSITIONS,
    ),
    *irrelevant(
        "--per-dataset-sequences-path --dataloader-fast-cache-load "
        "--dataloader-defer-npy-index-mmap --data-cache-path --no-mmap-bin-files --num-workers "
        "--num-dataset-builder-threads --object-storage-cache-path --mid-level-dataset-surplus "
        "--allow-ambiguous-pad-tokens --no-create-attention-mask-in-dataloader",
        DATASET,
    ),
    *irrelevant(
        "--encoder-seq-length --decoder-seq-length --sample-rate --mask-prob --short-seq-prob",
        NOT_GPT,
    ),
    *supported("--vocab-size", "the model's vocabulary (Megatron pads it)", test=HOST_TP1),
    *irrelevant(
        "--padded-vocab-size --no-pad-vocab-size --make-vocab-size-divisible-by --vocab-file "
        "--merge-file --vocab-extra-ids --tokenizer-type --tokenizer-model --tokenizer-metadata "
        "--tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens "
        "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
        "--tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens "
        "--trust-remote-code --null-tokenizer-eod-id --null-tokenizer-pad-id --chat-template",
        TOKENIZER,
    ),
]

ENTRY_POINT = [
    *supported(
        "--spec",
        "megatron_zeppelin.megatron.spec local or te (rebuilt from the run's config); a spec "
        "without Zeppelin's core attention is refused",
        test=HOOKS,
    ),
    *refused(
        "--yaml-cfg",
        "Zeppelin builds the model from the command line's arguments",
        change="give the model's flags instead of --yaml-cfg",
    ),
    *irrelevant("--hybrid-layer-pattern --hybrid-override-pattern", NOT_GPT),
    *refused(
        "--logits-load-dir",
        "distillation from saved logits replaces the loss of Megatron's pretrain_gpt.py, and "
        "Zeppelin's loss is its own",
        change="drop --logits-load-dir",
    ),
    *refused(
        "--logits-save-dir",
        "Megatron's pretrain_gpt.py saves the logits in its loss; Zeppelin's loss does not",
        change="drop --logits-save-dir",
    ),
    *irrelevant(
        "--logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --logits-save-dtype "
        "--logits-load-decode-threads --logits-load-prefetch-factor "
        "--logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha --logits-load-ignore-errors",
        ONLY_WITH.format("--logits-load-dir or --logits-save-dir"),
    ),
]

RUN_ANSWERS = [*PARALLEL, *TRAINING, *VALIDATION, *DATA, *ENTRY_POINT]
