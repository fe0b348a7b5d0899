"""What a recipe declares, as frozen dataclasses.

A recipe names a model family (architecture, dimensions, dtype, where the
checkpoint lives) and the capacity defaults its catalog is planned with. The
YAML files beside this module are read into these types once, by
``ignition.recipes.loader``; every field's ``metadata`` carries the rule the
loader checks and the words it uses when the rule is broken.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from ignition.recipes import rules

ARCHITECTURES = ("qwen3",)
DTYPES = ("float32", "bfloat16", "float16")
PROPOSAL_SOURCES = ("learned", "copy")
MAX_REQUEST_SLOTS = 64  # spec U11 / C7: mixed batches go up to 64 rows
UNDECLARED_COMPLETION_CAPACITY = 8  # spec C7: the core's default completion token capacity
COMPILE_MODES = ("none", "aoti")
MAX_CHECKPOINT_ROWS = 256
# Program kinds ignition builds (flare_contract.graphs.GraphKind values it has a builder for).
COMPILABLE_KINDS = ("prefill", "scored_prefill", "decode", "speculative", "mixed")


class RecipeError(ValueError):
    """A recipe (or the checkpoint it points at) is not usable; the message is one line."""


@dataclass(frozen=True, slots=True)
class ModelDims:
    """A Qwen3-family decoder's shape; names follow Hugging Face's config.json."""

    vocab_size: int = field(metadata=rules.positive())
    hidden_size: int = field(metadata=rules.positive())
    num_hidden_layers: int = field(metadata=rules.positive())
    num_attention_heads: int = field(metadata=rules.positive())
    num_key_value_heads: int = field(metadata=rules.positive())
    head_dim: int = field(metadata=rules.positive())
    intermediate_size: int = field(metadata=rules.positive())
    max_position_embeddings: int = field(metadata=rules.positive())
    rope_theta: float = field(metadata=rules.positive())
    rms_norm_eps: float = field(metadata=rules.positive())
    tie_word_embeddings: bool = False

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings

    def grouping_problem(self) -> str | None:
        """GQA needs whole groups of query heads per key/value head."""
        if self.num_attention_heads % self.num_key_value_heads:
            return (
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return None


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model's weights live and whether its dimensions are declared.

    ``checkpoint`` None means the user must pass ``--model PATH``;
    ``dimensions`` None means they are read from the checkpoint's config.json.
    Relative checkpoint paths are resolved against the recipe file's folder.
    """

    checkpoint: Path | None = None
    dimensions: ModelDims | None = None


@dataclass(frozen=True, slots=True)
class CapacityDefaults:
    """The envelope a plain ``ignition plan RECIPE`` uses; CLI flags override it."""

    concurrency: int = field(metadata=rules.between(1, MAX_REQUEST_SLOTS))
    prompt_buckets: tuple[int, ...] = field(metadata=rules.prompt_buckets())
    drafts: int = field(default=0, metadata=rules.at_least(0))
    proposal_sources: tuple[str, ...] = field(default=(), metadata=rules.subset_of(PROPOSAL_SOURCES))
    mixed_capture: bool = False
    # Explicit power-of-two request buckets; empty: every power of two through
    # the padded concurrency (spec C5).
    request_buckets: tuple[int, ...] = field(default=(), metadata=rules.request_buckets(MAX_REQUEST_SLOTS))
    completion_token_capacity: int = field(
        default=UNDECLARED_COMPLETION_CAPACITY, metadata=rules.between(1, MAX_REQUEST_SLOTS)
    )
    # Default --speculative-token-capacity R; None: derived (ignition.capacity.default_token_capacity).
    speculative_token_capacity: int | None = field(default=None, metadata=rules.at_least(1))


@dataclass(frozen=True, slots=True)
class CompileDefaults:
    """How capture prepares programs beyond ``torch.export``; ``--compile`` and
    ``--compile-kinds`` override it (docs/catalog-format.md, "Programs").

    ``aoti``: each program of the listed kinds (empty: every kind) also gets an
    AOTInductor package, which the runtime runs instead of interpreting the
    exported graph. A capture without a C++ compiler exports only, with a warning.
    ``max_width`` (None: any) limits that to programs verifying at most that many
    target positions per row: ``1`` compiles the width-one speculative programs
    adaptive speculation runs whenever no wider round pays, without the wider
    ones (each compile is a capture-time cost). ``max_prompt`` (None: any) likewise keeps
    the prompt programs of larger buckets exported: there the matrix products dwarf the
    per-op dispatch that compiling removes.
    """

    mode: str = field(default="none", metadata=rules.one_of(COMPILE_MODES))
    kinds: tuple[str, ...] = field(default=(), metadata=rules.subset_of(COMPILABLE_KINDS))
    max_width: int | None = field(default=None, metadata=rules.at_least(1))
    max_prompt: int | None = field(default=None, metadata=rules.at_least(1))


@dataclass(frozen=True, slots=True)
class CheckpointDefaults:
    """The checkpoint store the state programs copy into and out of (docs/checkpoints.md).

    ``rows``: checkpoint rows, each holding one slot's complete state at up to
    a full context (its KV pages, the draft's when there is one, the pending
    token, the committed length and the token history). 0: no store and no
    snapshot, restore or init programs.
    """

    rows: int = field(default=0, metadata=rules.between(0, MAX_CHECKPOINT_ROWS))


@dataclass(frozen=True, slots=True)
class Recipe:
    """One model family and its catalog defaults (see docs/cli.md for the YAML)."""

    name: str = field(metadata=rules.identifier())
    architecture: str = field(metadata=rules.one_of(ARCHITECTURES))
    dtype: str = field(metadata=rules.one_of(DTYPES))
    target: ModelSource
    capacity: CapacityDefaults
    aliases: tuple[str, ...] = field(default=(), metadata=rules.identifiers())
    description: str = ""
    tokenizer: str = "tokenizer.json"  # relative to the target checkpoint folder
    draft: ModelSource | None = None  # the learned-proposal model, if any
    kv_page_size: int = field(default=16, metadata=rules.power_of_two_between(1, 1024))
    compile: CompileDefaults = CompileDefaults()
    checkpoints: CheckpointDefaults = CheckpointDefaults()
    source: Path | None = None  # the YAML file it came from (set by the loader)

    @property
    def dims(self) -> ModelDims:
        if self.target.dimensions is None:
            raise RecipeError(
                f"recipe {self.name!r} reads its dimensions from the checkpoint's config.json: "
                "pass --model PATH (a local Hugging Face Qwen3 folder with config.json)"
            )
        return self.target.dimensions

    def resolve(self, model: Path | None = None) -> "Recipe":
        """Make the target's dimensions known, binding ``--model`` when given.

        With ``model``, its config.json is read (and must agree with any declared
        dimensions). Without it, declared dimensions suffice (planning needs no
        checkpoint); undeclared ones are read from the recipe's own checkpoint,
        and a recipe with neither asks for ``--model``.
        """
        # imported here because checkpoint.py builds this module's ModelDims
        from ignition.recipes.checkpoint import read_model_dims, require_agreement

        if model is None and self.target.dimensions is not None:
            return self
        checkpoint = self.checkpoint_folder(model)
        found = read_model_dims(checkpoint)
        if self.target.dimensions is not None:
            require_agreement(self.name, self.target.dimensions, found, checkpoint)
        return replace(self, target=ModelSource(checkpoint=checkpoint, dimensions=found))

    def checkpoint_folder(self, model: Path | None = None) -> Path:
        """The target checkpoint folder: ``--model`` wins over the recipe's own."""
        if model is not None:
            return Path(model)
        if self.target.checkpoint is None:
            raise RecipeError(
                f"recipe {self.name!r} has no bundled checkpoint: pass --model PATH "
                "(a local Hugging Face Qwen3 folder with config.json, *.safetensors, tokenizer.json)"
            )
        return self.target.checkpoint
