# Shared settings of the Zeppelin Slurm launchers; sourced by zeppelin_pretrain.sbatch and
# zeppelin_torchrun.sbatch, never run on its own. Every variable can be set before sbatch
# (sbatch exports the submitting shell's environment by default) to override the default here.

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
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT

# --- NCCL and the NICs ----------------------------------------------------------------------
# Megatron issues its kernels on one CUDA stream per device connection; with 1 connection the
# compute and communication kernels are queued in issue order, which the overlap of Zeppelin's
# ring transfers with attention (and Megatron's TP/DP overlap) relies on.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# The RDMA devices of the compute fabric, one per rail. Zeppelin routes inter-node bytes over
# every NIC of a node, so list all of them (and only them: storage NICs would steal traffic).
# DGX H100: mlx5_0..3,6..9 (4 and 5 are the storage/management ports). Run `ibv_devinfo` to list.
: "${NCCL_IB_HCA:=mlx5_0,mlx5_1,mlx5_2,mlx5_3,mlx5_6,mlx5_7,mlx5_8,mlx5_9}"
export NCCL_IB_HCA
# The TCP interface NCCL uses for its bootstrap (and as fallback transport): the management
# Ethernet, not the IB ports. Adjust to the name your nodes use (`ip -br link`).
: "${NCCL_SOCKET_IFNAME:=^lo,docker0}"
export NCCL_SOCKET_IFNAME
export GLOO_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME   # the gloo groups Megatron creates use the same port
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
# RoCE only: the GID index of the RoCE v2 address on each port (`show_gids`), usually 3;
# InfiniBand ignores it. UCX (used by some MPI / UCC builds) needs the same choice.
: "${NCCL_IB_GID_INDEX:=3}"
export NCCL_IB_GID_INDEX
export UCX_IB_GID_INDEX=$NCCL_IB_GID_INDEX
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-$(echo "$NCCL_IB_HCA" | sed 's/\(mlx5_[0-9]*\)/\1:1/g')}
# RoCE traffic class with lossless (PFC) priority on most fabrics; ask the network team.
: "${NCCL_IB_TC:=106}"
export NCCL_IB_TC
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
# space, so the strings below are split on white space where they are used.
ZEPPELIN_YAMLS="$ZEPPELIN_DIR/configs/models/$MODEL.yaml $ZEPPELIN_DIR/configs/clusters/$CLUSTER.yaml"
ZEPPELIN_TRAIN_ARGS="\
 --spec megatron_zeppelin.megatron.spec te\
 --micro-batch-size 1 --global-batch-size $GLOBAL_BATCH_SIZE --train-iters $TRAIN_ITERS\
 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 100\
 --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95\
 --data-path $DATA_PREFIX --split 998,1,1 $TOKENIZER_ARGS\
 --distributed-backend nccl --use-distributed-optimizer\
 --save $RUN_DIR/checkpoints --load $RUN_DIR/checkpoints --save-interval 500\
 --log-interval 10 --eval-interval 1000 --eval-iters 0\
 --tensorboard-dir $RUN_DIR/tensorboard"
# The program every rank runs, as one shell string for `bash -c` (inside the container).
ZEPPELIN_PRETRAIN="python $MEGATRON_DIR/pretrain_gpt.py\
 \$(python $ZEPPELIN_DIR/scripts/yaml_to_args.py $ZEPPELIN_YAMLS) $ZEPPELIN_TRAIN_ARGS"
export ZEPPELIN_YAMLS ZEPPELIN_TRAIN_ARGS ZEPPELIN_PRETRAIN
mkdir -p "$RUN_DIR"
