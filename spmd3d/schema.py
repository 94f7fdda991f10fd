"""The configuration's fields: frozen dataclasses, each field with its default and a one-line
meaning (`--help` prints them). Parsing, overrides and validation are `config.py`'s, which
re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "full", "save_dots", "stage", "offload", "offload_dots")
ROPE_SCALINGS = ("none", "llama3", "yarn")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "zb_h1")
ATTENTION_KERNELS = ("auto", "blocked", "cudnn", "pallas")
EXPERT_KERNELS = ("auto", "ragged", "tokamax", "mosaic")  # the experts' grouped matmul, grouped.py
EXPERT_WEIGHT_GRADS = ("auto", "xla", "pallas")  # its weights' gradient (grouped.py, tgmm.py)
FP8_RECIPES = ("off", "delayed")  # FP8 projections and their scaling (fp8.py)
FP8_ROLES, FP8_BINS = 3, 1024  # its state's sizes: input, weight, gradient; histogram bins
FP8_PROJECTIONS = 2  # per module that has FP8 state: qkv and o, gate_up and down (model.py)


def compute_dtype(dtype: str, platform: str) -> str:
    """`model.dtype` on `platform`: auto is bf16 compute on a GPU, fp32 elsewhere."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if platform == "gpu" else "float32"


class ConfigError(ValueError):
    """A configuration mistake; `field` is the dotted name to blame, str(self) is one line."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class DataError(ValueError):
    """Bad data input, blamed on one config field (`field`, e.g. 'data.path'); one line."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = " ".join(str(message).split())  # keep it to one line
        super().__init__(f"{field}: {self.message}")


def doc(default, help: str):
    """A dataclass field with a one-line meaning, read by `field_docs` for `--help`."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = doc(4, "transformer blocks (the stacked [L, ...] layers)")
    d_model: int = doc(256, "width of the residual stream")
    num_heads: int = doc(4, "query heads per attention layer")
    num_kv_heads: int = doc(2, "key/value heads (grouped-query attention)")
    d_ff: int = doc(768, "hidden width of the MLP")
    vocab_size: int = doc(256, "token ids are in [0, vocab_size)")
    head_dim: int = doc(0, "width of one head; 0: d_model // num_heads")
    rope_theta: float = doc(10000.0, "base of the rotary embedding frequencies")
    # LLaMA 3.1's long-context frequencies: the low ones divided by rope_factor, a smooth blend
    # between the two wavelength bounds (what transformers calls rope_type llama3)
    rope_scaling: str = doc("none", "none, llama3 (LLaMA 3.1 frequency scaling) or yarn "
                                    "(YaRN, as DeepSeek-V3 extends its context)")
    rope_factor: float = doc(8.0, "llama3, yarn: the low frequencies are divided by this")
    rope_low_freq_factor: float = doc(1.0, "llama3 scaling: bound of the unscaled wavelengths")
    rope_high_freq_factor: float = doc(4.0, "llama3 scaling: bound of the scaled wavelengths")
    rope_original_max_len: int = doc(8192, "llama3, yarn: the context it was pre-trained on")
    rope_beta_fast: float = doc(32.0, "yarn: rotations above which a frequency is kept")
    rope_beta_slow: float = doc(1.0, "yarn: rotations below which a frequency is divided")
    rope_mscale: float = doc(0.0, "yarn: cos/sin times m(mscale)/m(mscale_all_dim) (0: m(1))")
    rope_mscale_all_dim: float = doc(0.0, "yarn: m(s) = 0.1 s ln(factor) + 1; MLA's scores "
                                          "times m(mscale_all_dim)^2 (DeepSeek)")
    norm_eps: float = doc(1e-5, "epsilon of RMSNorm")
    init_std: float = doc(0.02, "standard deviation of the initial weights")
    dtype: str = doc("auto", "compute dtype: auto (bfloat16 on a GPU, float32 elsewhere), "
                             "float32, bfloat16 or float16")
    param_dtype: str = doc("float32", "dtype of the master weights and optimizer state")
    attention: str = doc("auto", "auto (on a GPU when the shapes allow: pallas with packed "
                                 "documents, else cudnn; blocked elsewhere), blocked (pure "
                                 "JAX), cudnn (cuDNN flash attention) or pallas (Pallas-Triton "
                                 "flash attention with document ids)")
    attention_tile: int = doc(1024, "the blocked kernel's and the ring's score tiles span at "
                                    "most this many tokens")
    qk_norm: bool = doc(False, "RMSNorm on each query and key head before RoPE (Qwen3)")
    # multi-head latent attention (mla.py, DeepSeek-V2/V3): keys and values from one
    # compressed latent, a rotary key part shared by the heads; num_kv_heads = num_heads
    kv_lora_rank: int = doc(0, "MLA when > 0: width of the compressed key/value latent "
                               "(DeepSeek-V3: 512); 0: grouped-query attention")
    q_lora_rank: int = doc(0, "MLA: width of the query latent (DeepSeek-V3: 1536); 0: "
                              "queries projected straight from d_model")
    qk_nope_head_dim: int = doc(128, "MLA: the part of a query/key head without positions")
    qk_rope_head_dim: int = doc(64, "MLA: the rotary part of a query/key head (one rotary key "
                                    "shared by all heads)")
    v_head_dim: int = doc(128, "MLA: width of a value head")
    # FP8 projections (fp8.py): QKV, attention output and the MLP's, e4m3 forward, e5m2
    # gradients, per-tensor scales; the rest stays in `dtype`
    fp8: str = doc("off", "FP8 projections: off, or delayed (each tensor's scale from its amax "
                          "over the last fp8_history steps; a Hopper GPU or later)")
    fp8_emulate: bool = doc(False, "FP8: the same casts and scales with the GEMMs in "
                                   "model.dtype, on any device (the CPU tests' mode)")
    fp8_history: int = doc(1024, "FP8 delayed scaling: steps of amax history a scale comes from")
    fp8_margin: int = doc(0, "FP8: each scale leaves 2^margin headroom above the amax")
    # Mixture-of-Experts (moe.py): every layer's MLP is `num_experts` SwiGLU experts, each
    # token sent to `experts_per_token` of them by a router, plus `shared_experts` every token
    # passes through
    num_experts: int = doc(0, "experts per MoE layer; 0: a dense MLP")
    dense_layers: int = doc(0, "MoE: the first k layers have a dense MLP of width d_ff "
                               "(DeepSeek-V3's first_k_dense_replace); a stack of their own that "
                               "runs before the pipeline, on every stage")
    moe_every: int = doc(1, "MoE: every n-th layer after dense_layers is MoE, the n-1 before it "
                            "dense (Qwen3-MoE's decoder_sparse_step, Llama 4's interleave step); "
                            "those n layers are one entry of the stack")
    experts_per_token: int = doc(2, "MoE: experts each token is sent to (top-k)")
    d_ff_expert: int = doc(0, "MoE: hidden width of one expert; 0: d_ff")
    shared_experts: int = doc(0, "MoE: experts of width d_ff_expert every token passes through")
    router_renormalize: bool = doc(True, "MoE: top-k weights divided by their sum (Mixtral; "
                                         "Qwen3-MoE's norm_topk_prob)")
    router_score: str = doc("softmax", "MoE: the router's scores: softmax (Mixtral, Qwen3-MoE) "
                                       "or sigmoid (DeepSeek-V3)")
    router_groups: int = doc(1, "MoE: groups of experts (DeepSeek-V3's n_group): a token's "
                                "experts come from its router_topk_groups best groups, each "
                                "ranked by the sum of its two best scores")
    router_topk_groups: int = doc(1, "MoE: groups a token's experts are chosen from "
                                     "(DeepSeek-V3's topk_group)")
    router_scale: float = doc(1.0, "MoE: the routed experts' weights times this "
                                   "(DeepSeek-V3's routed_scaling_factor)")
    router_aux_loss_coef: float = doc(0.0, "MoE: weight of the load-balancing loss (mean over "
                                           "layers); 0: off")
    router_z_loss_coef: float = doc(0.0, "MoE: weight of the router z-loss; 0: off")
    router_bias_rate: float = doc(0.0, "MoE: per-step change of the selection-only expert "
                                       "bias (DeepSeek-V3 balancing); 0: off")
    capacity_factor: float = doc(0.0, "MoE: an expert takes at most this x its even share of "
                                      "a device's assignments, the rest dropped; 0: dropless")
    expert_kernel: str = doc("auto", "MoE, dropless: the grouped matmul: auto (mosaic on a "
                                     "Hopper GPU, tokamax on other GPUs when installed, else "
                                     "ragged), ragged (jax.lax.ragged_dot), mosaic (jax's Pallas "
                                     "Mosaic GPU kernel) or tokamax (tokamax.ragged_dot)")
    expert_weight_grad: str = doc("auto", "MoE, dropless: the experts' weight gradient: auto "
                                          "(pallas on a GPU, else xla), xla (jax.lax."
                                          "ragged_dot_general) or pallas (tgmm.py's kernel)")
    # multi-token prediction (mtp.py, DeepSeek-V3): after the stack, each depth predicts one
    # token further from the last depth's state and the next token's embedding
    mtp_layers: int = doc(0, "MTP depths (DeepSeek-V3: 1), each a layer of the stack's kind; "
                             "0: off")
    mtp_loss_weight: float = doc(0.1, "MTP: the depths' mean loss times this joins the loss")

    is_moe = property(lambda self: self.num_experts > 0)
    expert_width = property(lambda self: self.d_ff_expert or self.d_ff)
    is_mla = property(lambda self: self.kv_lora_rank > 0)
    # the config of one of its dense layers (before the stack, or in an entry of it)
    dense_kind = property(lambda self: replace(self, num_experts=0, moe_every=1))

    @property
    def stacked_layers(self) -> int:
        """The entries of the main stack ([L, ...], scanned and pipelined): every layer but the
        dense ones before it, `moe_every` layers an entry (its dense ones, then an MoE one)."""
        return (self.num_layers - self.dense_layers) // self.moe_every

    @property
    def dim_per_head(self) -> int:
        """A query/key head's width (MLA: its no-position and rotary parts)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else
                self.head_dim or self.d_model // self.num_heads)

    @property
    def value_dim(self) -> int:
        """A value head's width."""
        return self.v_head_dim if self.is_mla else self.dim_per_head

    @property
    def rope_dim(self) -> int:
        """The rotated part of a query/key head."""
        return self.qk_rope_head_dim if self.is_mla else self.dim_per_head

    @property
    def attention_params(self) -> int:
        """One layer's attention weights: wq, wk, wv, wo; MLA's down and up projections."""
        d, n, h = self.d_model, self.num_heads, self.dim_per_head
        if not self.is_mla:
            return d * (n + 2 * self.num_kv_heads) * h + n * h * d
        q = d * n * h if not self.q_lora_rank else self.q_lora_rank * (d + n * h)
        c = self.kv_lora_rank
        return (q + d * (c + self.qk_rope_head_dim) + c * n * (self.qk_nope_head_dim + self.v_head_dim)
                + n * self.v_head_dim * d)

    @property
    def fp8_state(self) -> dict:
        """FP8's scaling state in one layer (`fp8.Fp8Meta`), {key under `blocks/`: shape}:
        the amax histories and probes of attention's projections and of the dense MLP's (an
        MoE layer's: its shared experts', if any); empty without `model.fp8`."""
        if self.fp8 == "off":
            return {}
        mlp = ("mlp/shared",) if self.shared_experts else ()
        return {f"{module}/fp8/{leaf}": (FP8_PROJECTIONS, FP8_ROLES, n)
                for module in ("attn",) + (mlp if self.is_moe else ("mlp",))
                for leaf, n in (("history", self.fp8_history), ("probe", FP8_BINS))}

    @property
    def layer_params(self) -> int:
        """One entry of the stack's matmul weights: attention's (`attention_params`) and the
        gated MLP's (the norms' 2 d are noise), and its dense layers' (`moe_every`)."""
        d, f = self.d_model, self.d_ff
        mlp = 3 * d * f if not self.is_moe else \
            3 * d * self.expert_width * (self.num_experts + self.shared_experts) + d * self.num_experts
        return self.attention_params + mlp + (self.moe_every - 1) * self.dense_layer_params

    @property
    def dense_layer_params(self) -> int:
        """`layer_params` of a dense layer (before the stack, or in an entry)."""
        return self.attention_params + 3 * self.d_model * self.d_ff

    @property
    def active_layer_params(self) -> int:
        """`layer_params` a token passes through: an MoE layer's top-k experts, not all."""
        if not self.is_moe:
            return self.layer_params
        idle = 3 * self.d_model * self.expert_width * (self.num_experts - self.experts_per_token)
        return self.layer_params - idle


@dataclass(frozen=True)
class MeshConfig:
    data: int = doc(-1, "data-parallel axis size; -1: all devices left over")
    stage: int = doc(1, "pipeline axis size (stages)")
    tensor: int = doc(2, "tensor-parallel axis size")
    seq: int = doc(1, "sequence axis size (ring attention)")
    # MoE: the experts are split `expert` ways over the data-parallel devices, each expert
    # shard replicated over the other data / expert (sharding.py, docs/moe.md)
    expert: int = doc(1, "expert-parallel degree, carved out of mesh.data (divides it)")
    # HSDP: ZeRO over a group of the data-parallel devices (a node's), whole copies across them
    replicate: int = doc(1, "HSDP: copies of the ZeRO-sharded state, carved out of mesh.data "
                            "(divides it): ZeRO shards over mesh.data / replicate devices "
                            "and plain data parallelism runs across the copies")
    simulated_devices: int = doc(-1, "N > 0: N simulated CPUs; -1: 8 if no accelerator; "
                                     "0: the real devices")
    topology: str = doc("auto", "a topology in meshes/ (its name) or a path to a .yaml; "
                                "auto: by platform")
    # With several hosts, tensor and seq must fit inside one host (their collectives run every
    # layer); true lets a layout put them across hosts anyway (slow, but it runs).
    allow_cross_host: bool = doc(False, "let tensor and seq span hosts")
    inside: str = doc("seq", "which of seq and tensor fills a host's devices first (seq: both "
                             "stay inside a host; tensor: tensor inside, and seq may span "
                             "hosts, as long context wants: the ring across nodes)")

    def sizes(self) -> dict[str, int]:
        """Mesh axis sizes; with expert parallelism, `data` is built as two axes, `data`
        (the expert replicas) x `expert` (mesh.EXPERT), and with HSDP `replicate` comes out
        of it too."""
        group = self.expert * self.replicate
        sizes = {"data": self.data // group if self.data > 0 else self.data, "stage": self.stage,
                 "tensor": self.tensor, "seq": self.seq}
        if self.expert > 1:
            sizes["expert"] = self.expert
        if self.replicate > 1:
            sizes["replicate"] = self.replicate
        return sizes

    @property
    def non_data(self) -> int:
        """stage x tensor x seq: the devices one data replica spans."""
        return self.stage * self.tensor * self.seq

    @property
    def num_devices(self) -> int:
        """data x stage x tensor x seq (`mesh.data` resolved, not -1)."""
        if self.data < 1:
            raise ConfigError("mesh.data", "is not resolved yet (-1: all devices left over)")
        return self.data * self.non_data


@dataclass(frozen=True)
class ParallelConfig:
    zero_stage: int = doc(1, "shard over data: optimizer state (1), + grads (2), + params (3)")
    pipeline_repeats: int = doc(1, "circular pipeline: chunks of layers per stage")
    pipeline_schedule: str = doc("gpipe", "gpipe (all forwards, then all backwards: saves m "
                                          "microbatches), 1f1b (one forward and one backward "
                                          "per tick: saves at most 2p-1; interleaved with "
                                          "repeats) or zb_h1 (zero bubble: B and W apart, W "
                                          "filling the bubble; saves at most p; interleaved "
                                          "with repeats)")
    sequence_parallel: bool = doc(False, "Megatron SP: norms and residual split over T (tensor)")
    context: str = doc("ring", "attention with the sequence split over seq: ring (zig-zag "
                               "ring), ulysses (two all-to-alls to a head split around the "
                               "local kernel; the kv heads of a tensor shard must divide by "
                               "seq), or auto (ulysses where it runs, else ring)")
    remat: str = doc("none", "none, full (keep layer inputs), save_dots (keep matmul outputs), "
                             "stage (keep only each stage's input per microbatch), offload "
                             "(full's layer inputs kept in host memory), offload_dots "
                             "(save_dots' matmul outputs kept in host memory)")
    # false unrolls the layer loop when tracing (each pipeline stage's chunk, with a pipeline):
    # no copies into stacked residual buffers, for compile time growing with depth (bench_small)
    scan_layers: bool = doc(True, "one compiled layer in a lax.scan; false: layers unrolled")
    zero3_gather: str = doc("step", "ZeRO-3 with a pipeline: gather each stage's layers once "
                                    "per step (step) or per layer at every tick (tick: less "
                                    "memory, stage weights x3 per tick over data)")
    tables_over_stage: bool = doc(False, "a pipeline: the weights used outside it (embedding, "
                                         "head, dense layers first) stored split over stage "
                                         "too and gathered where used (d_model % stage = 0)")
    loss_chunk: int = doc(1024, "tokens per device whose logits exist at once in the head "
                                "and loss (pieces in a loop); 0: all at once")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = doc(600, "optimizer steps")
    global_batch: int = doc(32, "sequences per step, over all devices")
    seq_len: int = doc(128, "tokens per sequence")
    microbatches: int = doc(1, "pipeline microbatches (or gradient accumulation steps)")
    seed: int = doc(0, "seed of the initial weights and the data order")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = doc(3e-3, "peak learning rate (AdamW)")
    warmup_steps: int = doc(10, "linear warm-up steps from 0 to lr")
    decay_steps: int = doc(0, "cosine decay ends here; 0: train.steps")
    min_lr_ratio: float = doc(0.1, "the decay ends at lr * min_lr_ratio")
    weight_decay: float = doc(0.1, "AdamW weight decay")
    clip_norm: float = doc(1.0, "clip the global gradient norm to this; 0: no clipping")
    b1: float = doc(0.9, "Adam decay of the first moment")
    b2: float = doc(0.95, "Adam decay of the second moment")
    eps: float = doc(1e-8, "Adam epsilon")
    moment_dtype: str = doc("auto", "dtype Adam's two moments are kept in: auto (the "
                                    "parameters'), float32, or bfloat16 (half the state; "
                                    "the update still computed in fp32)")


@dataclass(frozen=True)
class DataConfig:
    # The embedded corpus is Python's standard library sources: always there, nothing to download.
    path: str = doc("", "token file, text file or directory; empty: the embedded corpus")
    tokenizer: str = doc("bytes", "bytes (vocab 256), or a HF tokenizer.json or model directory")
    # held out from training: the corpus's last tokens, unless eval_path names other data
    eval_fraction: float = doc(0.01, "share of the corpus held out for eval_loss, in [0, 1)")
    eval_path: str = doc("", "held-out data (a file or directory as data.path); empty: split")
    # packed documents: a window's tokens attend only to their own document's, and the
    # prediction across an end-of-text token is not trained on (as LLaMA 3 was trained)
    # several sources by weight, each with its held-out part (data.eval_fraction of it)
    mixture: str = doc("", "sources by weight instead of data.path: PATH=WEIGHT,PATH=WEIGHT,...")
    document_mask: bool = doc(True, "attention stops at end-of-text tokens, where the "
                                     "tokenizer has one")


@dataclass(frozen=True)
class RunConfig:
    dir: str = doc("runs/demo", "config, metrics, checkpoints; one with checkpoints resumes")
    log_every: int = doc(1, "print a metrics line every N steps")
    explain: bool = doc(False, "print where every parameter lives")
    eval_every: int = doc(50, "held-out loss every N steps and at the end; 0: never")
    eval_batches: int = doc(4, "global batches of held-out windows per evaluation (fixed)")
    tensorboard: bool = doc(False, "also write TensorBoard events to run.dir/tensorboard")
    sample_every: int = doc(100, "print a sample (temperature 0.7, top-p 0.9, seed 0) every "
                                 "N steps and keep it in samples.jsonl; 0: never")
    sample_prompt: str = doc("def", "the text a sample continues")
    sample_tokens: int = doc(64, "new tokens per sample")
    xla_flags: str = doc("", "XLA flags added to (or overriding) the GPU preset, e.g. "
                             "\"--xla_gpu_enable_command_buffer=\"; GPU runs only")
    compile_cache: str = doc("", "directory of jax's persistent compilation cache: a restart "
                                 "onto a layout compiled before (an elastic one, a resume) "
                                 "loads its programs instead of compiling them; '' off")
    memory_check: bool = doc(True, "refuse a step that needs more memory than a device has, "
                                   "before the first step")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = doc(50, "save every N steps; 0: only at the end")
    keep: int = doc(3, "newest checkpoints kept")
    async_: bool = doc(True, "write while training goes on")  # YAML and argv: `async` (a keyword)
    fallback: bool = doc(False, "newest checkpoint damaged: resume from the one before")


@dataclass(frozen=True)
class DistConfig:
    """One training job over several processes (hosts); see `dist.py`. Left at these defaults,
    the values come from the environment (SLURM, Kubernetes, JAX_*), or it is one process."""

    coordinator: str = doc("", "HOST:PORT of the coordination service (process 0)")
    num_processes: int = doc(1, "processes (hosts) in the job")
    process_id: int = doc(0, "this process's index, in [0, num_processes)")
    # A process silent this long is declared lost and every other process stops (exit 1).
    heartbeat_timeout_s: int = doc(20, "seconds of silence before a process counts as lost")
    init_timeout_s: int = doc(300, "seconds the processes wait for each other at start-up")
    # elastic continuation (`elastic.py`, `launch/local.sh --elastic`)
    min_processes: int = doc(1, "an elastic job stops (exit 1) rather than go on with fewer")
    max_restarts: int = doc(3, "restarts an elastic job is allowed after losing hosts")


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dist: DistConfig = field(default_factory=DistConfig)
