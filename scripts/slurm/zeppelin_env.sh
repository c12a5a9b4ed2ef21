# Shared settings of the Zeppelin Slurm launchers; sourced by zeppelin_pretrain.sbatch and
# zeppelin_torchrun.sbatch, never run on its own. Every variable can be set before sbatch
# (sbatch exports the submitting shell's environment by default) to override the default here;
# EXTRA_ARGS adds Megatron flags to the command line (below, "the Megatron command line").

# --- what to train --------------------------------------------------------------------------
: "${CLUSTER:=dgx-h100}"          # configs/clusters/$CLUSTER.yaml: Zeppelin flags + topology preset
: "${MODEL:=llama-7b}"            # configs/models/$MODEL.yaml: Megatron model arguments
: "${DATA_PREFIX:?set DATA_PREFIX to a Megatron dataset prefix (PREFIX.bin/.idx), e.g. from zeppelin make-dataset}"
: "${TOKENIZER_ARGS:=--tokenizer-type NullTokenizer --vocab-size 32000}"  # HF: --tokenizer-type HuggingFaceTokenizer --tokenizer-model PATH
: "${TRAIN_ITERS:=1000}"
# Megatron's samples per step: a multiple of the data-parallel size (all GPUs / TP). Zeppelin's
# data hooks fill each micro-batch with whole documents up to the token capacity.
: "${GLOBAL_BATCH_SIZE:=$(( ${SLURM_NNODES:-1} * ${GPUS_PER_NODE:-8} ))}"
: "${RUN_DIR:=$PWD/runs/zeppelin-$CLUSTER-$MODEL}"
: "${ZEPPELIN_DIR:=/opt/megatron_zeppelin}"   # the plugin checkout (inside the container image)
: "${MEGATRON_DIR:=/opt/Megatron-LM}"         # patched Megatron-LM (scripts/apply_patch.sh)
: "${MASTER_PORT:=29500}"
: "${GPUS_PER_NODE:=8}"

# --- rendezvous -----------------------------------------------------------------------------
# The first host of the allocation runs the TCP store every rank connects to.
# (awk reads the whole list: `head -n 1` would close the pipe early, and under the launchers'
# `set -o pipefail` scontrol's SIGPIPE would fail the job now and then.)
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')
export MASTER_ADDR MASTER_PORT

# --- NCCL and the NICs ----------------------------------------------------------------------
# Megatron issues its kernels on one CUDA stream per device connection; with 1 connection the
# compute and communication kernels are queued in issue order, which the overlap of Zeppelin's
# ring transfers with attention (and Megatron's TP/DP overlap) relies on. (It is also why every
# rank posts its ring transfers on the node, rail and world communicators in one fixed order.)
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The cluster's own network settings: the `env:` section of configs/clusters/$CLUSTER.yaml
# (flat `NAME: value` lines; scripts/yaml_to_args.py skips it). A variable already set in the
# submitting shell wins over the file. dgx-h100.yaml lists the compute-fabric NICs
# (NCCL_IB_HCA, exact names after '='); the paper clusters' files leave the NIC names to you.
ZEPPELIN_ENV_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ZEPPELIN_CLUSTER_YAML="$ZEPPELIN_ENV_DIR/../../configs/clusters/$CLUSTER.yaml"
if [ ! -f "$ZEPPELIN_CLUSTER_YAML" ]; then
    echo "zeppelin_env.sh: no cluster file $ZEPPELIN_CLUSTER_YAML: set CLUSTER to one of" \
        "$(cd "$ZEPPELIN_ENV_DIR/../../configs/clusters" && ls -- *.yaml | sed 's/\.yaml//' | tr '\n' ' ')" >&2
    return 2 2>/dev/null || exit 2
fi
while IFS='=' read -r name value; do
    if [ -z "${!name+set}" ]; then export "$name=$value"; fi
done < <(awk '
    /^env:/ { inside = 1; next }
    inside && /^[^ \t#]/ { inside = 0 }
    inside && /^  [A-Za-z_][A-Za-z0-9_]*:/ {
        line = $0; sub(/^  /, "", line)
        name = line; sub(/:.*/, "", name)
        value = line; sub(/^[^:]*:[ \t]*/, "", value); sub(/[ \t]+#.*$/, "", value)
        if (value ~ /^".*"$/) { value = substr(value, 2, length(value) - 2) }
        print name "=" value
    }' "$ZEPPELIN_CLUSTER_YAML")
# NCCL's bootstrap (and fallback) TCP interface, in NCCL's syntax: a leading '^' excludes, '='
# matches names exactly, otherwise names are prefixes. Default: anything but loopback and Docker.
: "${NCCL_SOCKET_IFNAME:=^lo,docker0}"
export NCCL_SOCKET_IFNAME
# gloo (the CPU groups Megatron creates) reads GLOO_SOCKET_IFNAME as plain interface names,
# comma-separated: no '^' or '='. Unset, gloo binds to the address of the host name, which is
# right on most clusters; when NCCL's setting names interfaces (no '^'), gloo takes the same.
if [ -z "${GLOO_SOCKET_IFNAME+set}" ] && [[ "$NCCL_SOCKET_IFNAME" != ^* ]]; then
    export GLOO_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME#=}"
fi
# The RDMA devices of the compute fabric, one per rail, exact names after '=' (NCCL matches
# names without it as prefixes: mlx5_1 would also take mlx5_10 and mlx5_11). Zeppelin routes
# inter-node bytes over every NIC of a node, so list all of them and only them: storage NICs
# would steal traffic. `ibv_devinfo` lists the devices. Unset, NCCL uses every device it finds.
if [ -n "${NCCL_IB_HCA:-}" ]; then
    export NCCL_IB_HCA
    # UCX (some MPI / UCC builds) names the same devices with their port, without NCCL's '='.
    if [[ "$NCCL_IB_HCA" != ^* ]]; then
        : "${UCX_NET_DEVICES:=$(echo "${NCCL_IB_HCA#=}" | sed 's/\(mlx5_[0-9]*\)\(:[0-9]*\)\{0,1\}/\1:1/g')}"
        export UCX_NET_DEVICES
    fi
else
    echo "zeppelin_env.sh: NCCL_IB_HCA is not set for cluster $CLUSTER: NCCL will use every" \
        "RDMA device, storage NICs included; list the compute NICs in $ZEPPELIN_CLUSTER_YAML" >&2
fi
# Refuse settings NCCL or gloo would misread, with the line to change.
if [[ "${GLOO_SOCKET_IFNAME:-}" == *[\^=\ ]* ]]; then
    echo "zeppelin_env.sh: GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME: gloo takes interface names" \
        "only (no '^', '=' or spaces), e.g. GLOO_SOCKET_IFNAME=eth0" >&2
    return 2 2>/dev/null || exit 2
fi
if [ -n "${NCCL_IB_HCA:-}" ] && [[ "$NCCL_IB_HCA" != =* && "$NCCL_IB_HCA" != ^=* ]]; then
    echo "zeppelin_env.sh: NCCL_IB_HCA=$NCCL_IB_HCA matches device names as prefixes (mlx5_1" \
        "takes mlx5_10 too): write it with a leading '=', e.g. NCCL_IB_HCA==$NCCL_IB_HCA" >&2
    return 2 2>/dev/null || exit 2
fi
# GPUDirect RDMA: let the NIC read and write GPU memory directly when GPU and NIC share a PCIe
# switch (PIX) or bridge (PXB); farther apart, stage through host memory. SYS would force it
# everywhere, which is slower across CPU sockets.
export NCCL_NET_GDR_LEVEL=PXB
# Keep every connection on its rail (GPU j of node A talks through NIC j to GPU j of node B).
# Zeppelin's routing already sends each part of a message over the proxies' own rail, so NCCL
# must not move it to another NIC (0 = rails stay separate).
export NCCL_CROSS_NIC=0
# Queue pairs per connection: a few QPs spread one large ring message over more ECMP paths of a
# RoCE fabric and over more NIC engines; 4 is a common sweet spot for 400G NICs.
export NCCL_IB_QPS_PER_CONNECTION=4
# RoCE only: the GID index of the RoCE v2 address on each port (`show_gids`), usually 3, and the
# traffic class with lossless (PFC) priority, from the cluster file; InfiniBand needs neither.
# UCX needs the same GID index.
if [ -n "${NCCL_IB_GID_INDEX:-}" ]; then
    export NCCL_IB_GID_INDEX
    : "${UCX_IB_GID_INDEX:=$NCCL_IB_GID_INDEX}"
    export UCX_IB_GID_INDEX
fi
if [ -n "${NCCL_IB_TC:-}" ]; then export NCCL_IB_TC; fi
# Long rings of many small messages: fail a stuck transfer with a message rather than hang.
export NCCL_IB_TIMEOUT=22
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# Print NCCL's chosen rings, NICs and GDR mode once at start-up (WARN after a first good run).
: "${NCCL_DEBUG:=INFO}"
export NCCL_DEBUG NCCL_DEBUG_SUBSYS=INIT,NET

# --- the Megatron command line --------------------------------------------------------------
# Model and cluster YAMLs become flags (scripts/yaml_to_args.py, run where pyyaml is: inside the
# container). Zeppelin's topology preset (--zeppelin-topology) names the node design; the node
# count follows from the data-parallel size (Zeppelin spans the data-parallel ranks, tensor
# parallelism runs inside each), so one cluster file fits any allocation. No value holds a
# space, so the strings below are split on white space where they are used. --manual-gc keeps
# Python's collector from passing over the objects every plan brings while a step runs
# (docs/MEGATRON.md).
#
# Every part can be replaced before sbatch, and EXTRA_ARGS adds flags after all of them (Megatron
# takes the last value of a flag given twice, so EXTRA_ARGS can also change one):
#   SPEC_ARGS       the layer spec (the TransformerEngine one by default; "--spec
#                   megatron_zeppelin.megatron.spec local" without TransformerEngine)
#   LR_ARGS         learning rate and its schedule
#   OPTIMIZER_ARGS  weight decay, clipping, Adam
#   CHECKPOINT_ARGS where and how often to save, and what to load
#   LOG_ARGS        logging and TensorBoard
#   DATA_ARGS       the dataset and its train/valid/test split (by documents)
#   EVAL_ARGS       validation: how often and how many iterations
#   EXTRA_ARGS      anything else, e.g. EXTRA_ARGS="--seed 7 --moe-token-dispatcher-type alltoall"
#   ZEPPELIN_TRAIN_ARGS  all of the above at once: set, it is used as it is (EXTRA_ARGS still
#                   follows it)
ZEPPELIN_YAMLS="$ZEPPELIN_DIR/configs/models/$MODEL.yaml $ZEPPELIN_DIR/configs/clusters/$CLUSTER.yaml"
: "${SPEC_ARGS=--spec megatron_zeppelin.megatron.spec te}"
: "${LR_ARGS=--lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100}"
: "${OPTIMIZER_ARGS=--weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --use-distributed-optimizer}"
: "${CHECKPOINT_ARGS=--save $RUN_DIR/checkpoints --load $RUN_DIR/checkpoints --save-interval 500}"
: "${LOG_ARGS=--log-interval 10 --tensorboard-dir $RUN_DIR/tensorboard}"
: "${DATA_ARGS=--data-path $DATA_PREFIX --split 998,1,1}"
: "${EVAL_ARGS=--eval-interval 1000 --eval-iters 0}"
: "${EXTRA_ARGS=}"
: "${ZEPPELIN_TRAIN_ARGS=$SPEC_ARGS\
 --micro-batch-size 1 --global-batch-size $GLOBAL_BATCH_SIZE --train-iters $TRAIN_ITERS\
 $LR_ARGS $OPTIMIZER_ARGS\
 $DATA_ARGS $TOKENIZER_ARGS --distributed-backend nccl\
 $CHECKPOINT_ARGS $LOG_ARGS $EVAL_ARGS --manual-gc}"
# The program every rank runs, as one shell string for `bash -c` (inside the container).
ZEPPELIN_PRETRAIN="python $MEGATRON_DIR/pretrain_gpt.py\
 \$(python $ZEPPELIN_DIR/scripts/yaml_to_args.py $ZEPPELIN_YAMLS) $ZEPPELIN_TRAIN_ARGS $EXTRA_ARGS"
export ZEPPELIN_YAMLS ZEPPELIN_TRAIN_ARGS EXTRA_ARGS ZEPPELIN_PRETRAIN
mkdir -p "$RUN_DIR"
