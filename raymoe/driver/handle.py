"""The driver-side model handle ``raymoe.from_pretrained`` returns (SPEC RAY-3, INF-1, TRAIN-2/3): one object, its
concerns in rooms of their own.

    DistributedModel (this facade)      checks nothing itself; each call goes to the room of its concern
      inference.Inference               __call__ (logits), generate, generate_stream
      loaded_view.LoadedView            what was loaded: topology, plans, lora, precision, describe (inherited)
      rl_methods.ReinforcementMethods   logprobs, iter_hub_weights, push_weights (RL; inherited)
      streamed_methods.StreamedMethods  train_step_streamed, evaluate_streamed (rows in Ray's object store)
      training.TrainingSession          configure_training, train_step (policy losses: policy.py), evaluate
      hub_save.save_pretrained          save_pretrained
      states.TrainingStates             save_state, wait_for_save, check_state, load_state
      tenancy.RankLease                 who holds the ranks: shutdown, restart, is_alive
      fanout.FanOut                     the one way every room reaches the ranks

Nothing here touches a tensor of the model. A handle either owns its group (``from_pretrained`` started it for
this model: ``shutdown`` ends the ranks) or borrows a world the user started (``from_pretrained(..., world=...)``:
``shutdown`` unloads the model and leaves the ranks running for the next one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from torch import Tensor

from raymoe.checkpoint.storage import StorageUrl, UserPath
from raymoe.checkpoint.training_state import StateManifest
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.driver.adapters import save_adapter
from raymoe.driver.fanout import FanOut
from raymoe.driver.group import RankGroup
from raymoe.driver.hub_save import save_pretrained
from raymoe.driver.inference import GenerationOptions, Inference
from raymoe.driver.loaded_view import LoadedView
from raymoe.driver.local_paths import storage_path
from raymoe.driver.logprobs import Logprobs
from raymoe.driver.memory_plan import describe_memory
from raymoe.driver.policy import prepare_policy
from raymoe.driver.rl_methods import ReinforcementMethods
from raymoe.driver.routes import check_routes
from raymoe.driver.states import CheckedState, TrainingStates
from raymoe.driver.streamed_methods import StreamedMethods
from raymoe.driver.tenancy import RankLease
from raymoe.driver.training import TrainingSession
from raymoe.models.common.config import ModelConfig
from raymoe.rank.contract import LoadReport, RankMemory
from raymoe.rank.footprint import held_memory
from raymoe.rank.load import load_shards
from raymoe.spec.balance import DEFAULT_BIAS_UPDATE_RATE, BalanceConfig, BalanceOptions
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.optimizer import OptimizerConfig
from raymoe.spec.policy import PolicyLossFn
from raymoe.spec.shared_paths import SharedPath, read_path, remove_marker, write_path


class DistributedModel(LoadedView, ReinforcementMethods, StreamedMethods):
    """A model sharded over rank processes. Use as a context manager, or call :meth:`shutdown`."""

    def __init__(self, spec: LaunchSpec, group: RankGroup, load_reports: list[LoadReport], *, owns_group: bool) -> None:
        self._spec = spec
        self.load_reports = load_reports
        self.model_config: ModelConfig = spec.config
        tenant = f"{spec.config.model_type} from {spec.source!r}"
        self._lease = lease = RankLease(self, group, owns_group=owns_group, tenant=tenant)
        fanout = FanOut(lease.group, spec.topology)
        # The rooms hold the lease, never the handle: collecting the handle releases its ranks.
        self._inference = Inference(spec.config, fanout, lambda: lease.is_alive)
        self._training = TrainingSession(spec.config, fanout, load_reports[0].precision)
        self._logprobs = Logprobs(spec.config, fanout)
        self._states = TrainingStates(spec, self._training, fanout)
        self._fanout = fanout

    @classmethod
    def launch(cls, spec: LaunchSpec, group: RankGroup, *, owns_group: bool) -> DistributedModel:
        """Load ``spec`` on ``group`` (its layout first); an owned group is shut down if loading fails.

        A borrowed world hosts one model at a time: loading onto one whose model is still open is a ``ValueError``.
        """
        if not owns_group:
            RankLease.check_vacant(group)
        return cls(spec, group, _load(spec, group, owns_group), owns_group=owns_group)

    # --- inference ------------------------------------------------------------------------------

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        return_logits: str = "all",
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits of the global batch ``input_ids [B, S]`` (any ``B``), gathered on the driver.

        ``return_logits="all"``: ``[B, S, V]``, every position (transformers' ``model(ids).logits``);
        ``"last"``: ``[B, V]`` at each row's last real token, the ``[B, S, V]`` tensor never built.
        ``attention_mask [B, S]`` (1: real token) may pad rows on either side. ``document_ids [B, S]``:
        packed rows, each run of equal ids a document that sees only itself, its positions from 0.
        """
        return self._inference.logits(input_ids, attention_mask, return_logits, document_ids)

    def generate(
        self,
        prompts: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        **options: Any,
    ) -> Any:
        """Continue each prompt by up to ``max_new_tokens`` tokens (greedy by default), with a KV cache on every rank.

        ``prompts``: a ``[B, S]`` tensor (left-padded with ``attention_mask``) -> ``[B, S + n]``, rows that
        finished early padded with ``pad_token_id``; or a list of token-id lists of any lengths -> a list of
        prompt + continuation lists, no padding. Any ``B`` on any layout. ``options`` are the fields of
        :class:`~raymoe.driver.inference.GenerationOptions`: ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``seed``, ``eos_token_ids``, ``stop_sequences``, ``pad_token_id``, ``return_routed_experts`` (then
        ``(tokens, routes)``: every token's experts ``[B, S + n, L_moe, K]`` int16, or ``[n_b, L_moe, K]`` per list).
        """
        choice = GenerationOptions.of("generate", options)
        return self._inference.generate(prompts, max_new_tokens, attention_mask, choice)

    def generate_stream(
        self,
        prompts: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        **options: Any,
    ) -> Iterator[list[int | None]]:
        """:meth:`generate` one step at a time: yields, per step, each row's new token (None once it finished).

        The same tokens as :meth:`generate` with the same arguments. Checked before the first step;
        stopping the iteration early frees the ranks' KV caches.
        """
        choice = GenerationOptions.of("generate_stream", options)
        return self._inference.stream(prompts, max_new_tokens, attention_mask, choice)

    # --- training -------------------------------------------------------------------------------

    def configure_training(
        self,
        lr: float = OptimizerConfig.lr,
        weight_decay: float = OptimizerConfig.weight_decay,
        betas: tuple[float, float] = OptimizerConfig.betas,
        eps: float = OptimizerConfig.eps,
        max_grad_norm: float | None = OptimizerConfig.max_grad_norm,
        *,
        balance: str = "auto",
        router_aux_loss_coef: float | None = None,
        bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE,
        capacity_factor: float | None = None,
        telemetry: bool = True,
    ) -> None:
        """AdamW on every rank (defaults: :class:`~raymoe.spec.optimizer.OptimizerConfig`; ``max_grad_norm=None``
        means no clipping) and load balancing (:mod:`raymoe.spec.balance`).

        ``balance="auto"`` follows the checkpoint (the aux loss iff its config.json has
        ``output_router_logits``); ``router_aux_loss_coef`` overrides the checkpoint's coefficient (and, under
        ``"auto"``, turns the aux loss on); ``"bias"`` moves the routers' selection bias by
        ``bias_update_rate`` after each step; ``capacity_factor`` drops pairs beyond each expert's share of a
        sequence; ``telemetry=False`` stops recording routing choices (no load metrics) unless a method
        needs them. Every value is checked here, before any rank is asked.
        """
        optimizer = OptimizerConfig(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, max_grad_norm=max_grad_norm)
        options = BalanceOptions(balance, router_aux_loss_coef, bias_update_rate, capacity_factor, telemetry)
        self.use_training_config(optimizer, options)

    def use_training_config(self, optimizer: OptimizerConfig, balance: BalanceOptions | None = None) -> None:
        """:meth:`configure_training` from settings objects (what the Trainer passes); the step count restarts at 0."""
        self._training.configure(optimizer, balance if balance is not None else BalanceOptions())

    @property
    def step(self) -> int:
        """Optimizer steps taken since ``configure_training`` (or restored by ``load_state``)."""
        return self._training.step

    @property
    def balance(self) -> BalanceConfig:
        """The load-balancing settings the ranks train with (from the last ``configure_training``)."""
        return self._training.balance

    def train_step(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        lr: float | None = None,
        micro_batches: int = 1,
        *,
        document_ids: Tensor | None = None,
        loss: str | PolicyLossFn = "cross_entropy",
        advantages: Tensor | None = None,
        old_logprobs: Tensor | None = None,
        ref_logprobs: Tensor | None = None,
        loss_mask: Tensor | None = None,
        routed_experts: Tensor | None = None,
        **loss_options: Any,
    ) -> dict[str, Any]:
        """One optimizer step on the global batch; the loss is the mean over all its label tokens.

        ``labels`` default to ``input_ids``; label ``-100`` and ``attention_mask == 0`` take no loss.
        ``document_ids [B, S]`` packs documents into rows: each run of equal ids is a document that attends
        only to itself, with positions from 0, and its first token is no target of the previous document.
        ``lr`` overrides the learning rate from this step on (schedules set it every step).
        ``micro_batches > 1`` splits each rank's rows into that many forward/backward passes
        (gradient accumulation) before the one optimizer step.

        Returns ``loss`` (``lm_loss + aux_loss_coef * aux_loss``), ``lm_loss``, ``grad_norm``, ``num_tokens``,
        ``lr`` and, for MoE models, per MoE layer ``expert_load``, ``expert_imbalance``, ``rank_load``,
        ``rank_imbalance``, ``dead_experts``, ``dropped_pairs``, and the step's ``aux_loss`` (reported even
        when its coefficient ``aux_loss_coef`` is 0); ``compile_s`` on a step that compiled the decoder blocks
        (a new shape's first, ``compile=``).

        RL: ``loss="importance_sampling"``, ``"ppo"`` or a callable, with ``[B, S]`` ``advantages``,
        ``old_logprobs``, ``ref_logprobs``, ``loss_mask`` aligned as :meth:`logprobs` answers, and
        ``loss_options`` (``clip_low``, ``clip_high``, ``clip_c``, ``kl_coef``, ``loss_aggregation``,
        ``max_new_tokens``, ``temperature``): :mod:`raymoe.spec.policy`. Returns ``loss``, ``policy_loss``, ``kl``,
        ``clip_fraction``, ``approx_kl``, ``grad_norm``, ``num_tokens``. ``routed_experts [B, S, L_moe, K]``: the
        routers replay these experts (see :meth:`logprobs`).
        """
        batch = self._training.global_batch(input_ids, labels, attention_mask, document_ids)
        given = {"advantages": advantages, "old_logprobs": old_logprobs, "ref_logprobs": ref_logprobs}
        policy = prepare_policy(batch, loss, loss_options, given, loss_mask)
        routes = None
        if routed_experts is not None:
            routes = check_routes(routed_experts, self.model_config, batch.input_ids, "train_step")
        return self._training.train_step(batch, micro_batches, lr, policy, routes)

    def evaluate(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        micro_batches: int = 1,
        *,
        document_ids: Tensor | None = None,
    ) -> dict[str, Any]:
        """Mean loss over all label tokens of the global batch, forward only: no gradients, no optimizer step.

        Batches (``document_ids`` too) as in :meth:`train_step`. Returns ``loss``, ``loss_sum``, ``num_tokens`` (so
        batches combine exactly: ``sum(loss_sum) / sum(num_tokens)``), ``compile_s`` as :meth:`train_step` does."""
        batch = self._training.global_batch(input_ids, labels, attention_mask, document_ids)
        return self._training.evaluate(batch, micro_batches)

    # --- checkpoints and training states ----------------------------------------------------------

    def save_pretrained(self, path: UserPath, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path] | list[str]:
        """Gather the weights into a hub-layout checkpoint at ``path`` (written by rank 0, on its node; a storage URL
        such as ``s3://bucket/ckpt`` is uploaded from there, :mod:`raymoe.checkpoint.upload`).

        All or nothing (a local path): the new checkpoint is staged beside ``path`` and swapped in whole, keeping
        the files there it does not write (a tokenizer). A failure (a full disk, an I/O error, a check of the
        written files) raises one :class:`~raymoe.checkpoint.staging.CheckpointSaveError` (``errno`` the disk's
        code) naming the path, the file and the cause; ``path`` keeps the previous checkpoint and the model stays
        loaded, weights and optimizer state."""
        return save_pretrained(self._fanout, path, max_shard_size)

    def save_adapter(self, path: UserPath) -> list[Path] | list[str]:
        """Write the LoRA adapters as a PEFT directory at ``path`` (``adapter_config.json``,
        ``adapter_model.safetensors``: the keys and shapes PEFT gives the transformers model of this family), so
        ``peft.PeftModel.from_pretrained(transformers_model, path)`` and ``from_pretrained(..., lora=path)`` load
        it. All or nothing, like :meth:`save_pretrained` (which writes the merged model, ``W + s B A``)."""
        return save_adapter(self._fanout, self._spec, path)

    def save_state(
        self, path: UserPath, *, async_save: bool = False, extra: Mapping[str, Any] | None = None
    ) -> Path | StorageUrl:
        """Write the whole training state to the directory ``path``: model shards, AdamW moments and step counts,
        the router selection biases (bias balancing), every rank's RNG, :attr:`step`, the optimizer and balance
        settings, and ``extra`` (any JSON-serialisable dict, e.g. a data position; :meth:`load_state` returns it).

        Every rank writes its own shards in parallel (torch DCP, no gather), into a directory beside ``path``
        that rank 0 swaps in whole once every rank has finished: ``path`` holds the previous state until then,
        and a save that fails or is killed never leaves a half state there. A failure raises
        :class:`~raymoe.checkpoint.staging.CheckpointSaveError` naming the rank, the file and the cause; the
        model stays loaded, weights and optimizer state.

        ``async_save=True`` returns once every rank has copied its shards to CPU memory; the writing goes on
        while training continues. The next ``save_state``, ``load_state``, :meth:`wait_for_save` or
        ``shutdown`` waits for it and raises its failure. ``path`` may be a storage URL (``s3://bucket/run/state``:
        a generation made visible by one commit marker, :mod:`raymoe.checkpoint.committed`)."""
        target = storage_path(path, "save_state path", write=True)
        if isinstance(target, Path):
            self.check_shared([write_path("save_state path", target.parent)])
        return self._states.save(target, async_save, extra)

    def wait_for_save(self) -> Path | StorageUrl | None:
        """Wait for an asynchronous :meth:`save_state` to be written and swapped in; its directory, or None when
        none was in flight. Raises its failure (``CheckpointSaveError``); the previous state is then intact."""
        return self._states.wait()

    def check_state(self, path: UserPath) -> CheckedState:
        """Check a :meth:`save_state` directory against this model on the driver, reading nothing on the ranks:
        manifest, model type, every tensor name and shape, every data file present and long enough. A
        :class:`~raymoe.checkpoint.training_state.TrainingStateError` names the directory and the problem; the
        result (``.manifest``: ``step``, ``extra``) can be passed to :meth:`load_state`."""
        return self._states.check(path)

    def load_state(self, path: UserPath | CheckedState) -> StateManifest:
        """Restore a :meth:`save_state` directory into this handle, whatever layout and world size saved it.

        Checked on the driver first (:meth:`check_state`, unless ``path`` is its result): a
        :class:`~raymoe.checkpoint.training_state.TrainingStateError` naming the directory and the problem, before
        any rank reads. Then every rank reads its own shards (DCP reshards); only when all succeeded do they
        become the weights, a new AdamW with the saved settings and moments, the balance settings and the RNG
        (rank ``r`` gets saved rank ``r``'s, where the saved world had one). A failed read changes nothing.
        Returns the manifest (``step``, ``extra``). Needs no ``configure_training`` before.
        """
        self._states.wait()
        checked = path if isinstance(path, CheckedState) else self._states.check(path)
        if isinstance(checked.directory, Path):
            self.check_shared([read_path("load_state path", checked.directory, every_file=True)])
        return self._states.load(checked)

    def check_shared(self, needs: Sequence[SharedPath]) -> None:
        """Raise one ``ValueError`` when a node hosting ranks does not see these local paths as the driver does
        (:mod:`raymoe.spec.shared_paths`: files missing or of another size, a written marker not there); nothing
        runs when every rank is on the driver's node. The markers of write paths are removed after."""
        try:
            self._lease.group().check_shared(needs)
        finally:
            for need in needs:
                remove_marker(need)

    def memory(self) -> list[RankMemory]:
        """What every rank holds now, measured from its shards, in rank order (:class:`RankMemory`): parameters,
        gradients (present only between a backward and its step), AdamW states (from the first step). What
        ``raymoe.plan`` predicts for the layout, exactly."""
        return self._lease.group().execute(held_memory)

    def describe(self) -> str:
        """The rank picture of this layout (SPEC TOPO-3), the precision policy, the adapters, and what each rank
        holds (:meth:`memory`)."""
        return f"{self.picture()}\n{describe_memory(self.memory())}"

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank, results in rank order: for inspecting or extending
        what the ranks hold (``ctx.require_model().model`` is this rank's shard of the model; under pipelines
        ``.parts``, its stages). ``fn`` travels by pickle; a rank's exception ends the group like any rank failure."""
        return self._lease.group().execute(fn, *args, **kwargs)

    # --- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the ranks: stop them (a group this handle started) or unload the model from a borrowed
        world (``from_pretrained(..., world=...)``). Safe to call more than once. Waits for an asynchronous
        ``save_state`` first, and raises its failure after releasing the ranks."""
        try:
            if self._states.saving is not None and self.is_alive:
                self._states.wait()
        finally:
            self._states.saving = None
            self._lease.release()

    def restart(self) -> None:
        """Replace ranks that failed (a rank died or hung, which ended the group) with new rank actors, placed
        afresh (on other nodes if a node is gone; waiting up to ``placement_timeout_s`` for room), and load the
        model from its source again. Training settings are gone with the old ranks: call ``configure_training``
        or ``load_state`` next. Only for a model ``from_pretrained`` started ranks for (not on a borrowed world)."""
        group = self._lease.replace(self)
        self.load_reports = _load(self._spec, group, owns_group=True)
        self._training.forget()
        self._states.saving = None

    @property
    def is_alive(self) -> bool:
        """True until :meth:`shutdown` (or a rank failure that ended the group)."""
        return self._lease.is_alive

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else "shut down"
        return (
            f"DistributedModel({self.model_config.model_type} from {self._spec.source!r}, "
            f"{self.topology.config!r}, {state})\n{self.picture()}"
        )


def _load(spec: LaunchSpec, group: RankGroup, owns_group: bool) -> list[LoadReport]:
    """Put ``group`` in ``spec``'s layout and load the shards; an owned group is shut down if that fails."""
    try:
        group.use_layout(spec.topology)
        reports: list[LoadReport] = group.execute(load_shards, spec)
    except BaseException:
        if owns_group:
            group.shutdown()
        raise
    return reports
