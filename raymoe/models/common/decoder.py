"""The decoder-only causal LM shared by every family: embedding -> layers -> norm -> head.

Module and parameter names are the hub checkpoint's (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ``model.layers.{i}.mlp...``, ``model.norm``,
``lm_head``), so plans, checkpoints and transformers' state dicts use one vocabulary. A family
subclasses :class:`CausalLM` to choose each layer's feed-forward, its default plans and, where
it fuses hub tensors, its hub layout.

Shape legend: ``B`` batch, ``S`` tokens, ``H`` hidden size, ``D`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import ClassVar

import torch
from torch import Tensor, nn

from raymoe.models.common.attention import Attention
from raymoe.models.common.config import ModelConfig
from raymoe.models.common.hub_layout import HubLayout
from raymoe.models.common.kv_cache import KVCache, LayerKVCache
from raymoe.models.common.lora import is_adapter_name
from raymoe.models.common.norm import RMSNorm
from raymoe.models.common.packing import pack_documents
from raymoe.models.common.plans import DefaultPlans
from raymoe.models.common.rope import rope_cos_sin
from raymoe.models.common.sequence_split import ResidualSplit, SequenceSplit, TokenLayout
from raymoe.models.moe import GroupedExperts, TopKRouter
from raymoe.models.moe.packed import packed_companions


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``h + mlp(norm(h))``. ``[B, S, H]`` in and out."""

    def __init__(
        self, config: ModelConfig, mlp: nn.Module, layer_idx: int = 0, attention: nn.Module | None = None
    ) -> None:
        super().__init__()
        # Any module with Attention's forward (DeepSeek-V3's multi-head latent attention); grouped-query by default.
        self.self_attn = attention if attention is not None else Attention(config, layer_idx)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x_BSH: Tensor,
        cos_SD: Tensor,
        sin_SD: Tensor,
        cache: LayerKVCache | None = None,
        start: int = 0,
        key_mask_BL: Tensor | None = None,
        layout: TokenLayout | None = None,
        routes_BSK: Tensor | None = None,
        residual: ResidualSplit | None = None,
    ) -> Tensor:
        """``layout``: packed rows or a split row (:mod:`raymoe.models.common.sequence_split`); ``routes [B, S, K]``:
        replayed expert ids for a sparse layer's router (None: its own choice); ``residual``: ``x`` is a share of the
        sequence (sequence parallelism), and so is the output."""
        attn_in_BSH = self.input_layernorm(x_BSH)
        if residual is not None:
            attn_in_BSH = residual.whole(attn_in_BSH)
        attn_BSH = self.self_attn(attn_in_BSH, cos_SD, sin_SD, cache, start, key_mask_BL, layout)
        h_BSH = x_BSH + (residual.share(attn_BSH) if residual is not None else attn_BSH)
        mlp_in_BSH = self.post_attention_layernorm(h_BSH)
        if residual is not None:
            mlp_in_BSH = residual.whole(mlp_in_BSH)
        mlp_BSH = self.mlp(mlp_in_BSH) if routes_BSK is None else self.mlp(mlp_in_BSH, routes_BSK)
        out_BSH: Tensor = h_BSH + (residual.share(mlp_BSH) if residual is not None else mlp_BSH)
        return out_BSH


class SkippedLayer(nn.Module):
    """Stands in for a decoder layer a model part does not run (:meth:`CausalLM.keep_part`): no parameters,
    its input passes through, and the other layers keep their indices (and so their parameter names)."""

    def forward(self, x_BSH: Tensor, *args: object) -> Tensor:
        return x_BSH


class DecoderModel(nn.Module):
    """``input_ids [B, S]`` -> final hidden states ``[B, S, H]`` (the hub's ``model.`` prefix).

    A part of the model (:meth:`CausalLM.keep_part`) may lack the embedding (it then takes hidden states
    ``[B, S, H]`` in place of token ids) and the final norm (it returns its last layer's output).

    With ``sequence_split`` set (context parallelism; the rank code sets it for the duration of a forward:
    ``raymoe.parallel.sequence_shares``), a forward runs on the split's share of every row: token ids,
    ``document_ids`` and ``routes`` come as full rows (ids are cut before the embedding), hidden states in and out
    are the share only.
    With ``residual_split`` set too (sequence parallelism), the residual stream between the embedding and the final
    norm is a share of that along the sequence (:class:`~raymoe.models.common.sequence_split.ResidualSplit`); the
    head gets the whole of it.
    """

    embed_tokens: nn.Embedding | None
    norm: RMSNorm | None
    sequence_split: SequenceSplit | None
    residual_split: ResidualSplit | None

    def __init__(self, config: ModelConfig, layers: list[DecoderLayer]) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.sequence_split = None
        self.residual_split = None

    def forward(
        self,
        input_ids_BS: Tensor,
        cache: KVCache | None = None,
        attention_mask_BS: Tensor | None = None,
        document_ids_BS: Tensor | None = None,
        routes_BSLK: Tensor | None = None,
    ) -> Tensor:
        """With ``cache``, the tokens continue the cached ones: positions start at ``cache.length``.
        Without an embedding (a later part of the model) ``input_ids`` are the hidden states ``[B, S, H]``.

        ``attention_mask [B, S]`` (1: a real token, 0: left padding) gives each row its own positions
        (its real tokens count from 0) and hides the padding from attention, here and in later cached steps.
        ``document_ids [B, S]`` packs several documents into a row (:mod:`raymoe.models.common.packing`):
        positions restart at each document and attention stays inside it, so each document's hidden states
        are those it would have alone. Padding is then a document of its own, or at a row's end (where no real
        token sees it): ``attention_mask`` is not read. ``routes [B, S, L_moe, K]``: replayed expert ids, slot
        ``j`` for the model's ``j``-th sparse layer (of the whole model, also in a part that runs some layers).
        """
        start = cache.length if cache is not None else 0
        layout: TokenLayout | None = None
        key_mask_BL: Tensor | None = None
        if self.sequence_split is not None:
            if cache is not None or attention_mask_BS is not None:
                raise ValueError(
                    "a forward split over ranks (context parallelism) takes whole right-padded rows: no KV cache, "
                    "no attention_mask"
                )
            split = self.sequence_split
            input_ids_BS, routes_BSLK, layout = self._split(split, input_ids_BS, document_ids_BS, routes_BSLK)
        x_BSH = self.embed_tokens(input_ids_BS) if self.embed_tokens is not None else input_ids_BS
        if layout is None and document_ids_BS is not None:
            if cache is not None:
                raise ValueError("document_ids packs documents for training and evaluation; it takes no KV cache")
            layout = pack_documents(document_ids_BS)
        if layout is not None:
            positions = layout.positions_BS
        else:
            positions, key_mask_BL = _positions(x_BSH.shape[:2], x_BSH.device, cache, attention_mask_BS, start)
        cos_SD, sin_SD = rope_cos_sin(self.config.rope, self.config.rope_dim, positions, x_BSH.dtype)
        residual = self.residual_split
        if residual is not None:
            if cache is not None or self.embed_tokens is None or self.norm is None:
                raise ValueError("a residual stream split along the sequence takes a whole model and no KV cache")
            x_BSH = residual.share(x_BSH)
        slots = self.config.sparse_slots() if routes_BSLK is not None else {}
        for i, layer in enumerate(self.layers):
            layer_cache = cache.layers[i] if cache is not None else None
            routes_BSK = routes_BSLK[:, :, slots[i]] if routes_BSLK is not None and i in slots else None
            x_BSH = layer(x_BSH, cos_SD, sin_SD, layer_cache, start, key_mask_BL, layout, routes_BSK, residual)
        if cache is not None:
            cache.advance(x_BSH.shape[1])
        if self.norm is None:
            return x_BSH
        out_BSH: Tensor = self.norm(x_BSH)
        return residual.whole(out_BSH) if residual is not None else out_BSH

    def _split(
        self, split: SequenceSplit, input_BS: Tensor, document_ids_BS: Tensor | None, routes_BSLK: Tensor | None
    ) -> tuple[Tensor, Tensor | None, TokenLayout]:
        """``(this share of the ids, of the routes, the layout)``; hidden states (a later part) are a share already."""
        rows, width = input_BS.shape[:2]
        full = width if self.embed_tokens is not None else split.full_length(width)
        ids = split.cut(input_BS) if self.embed_tokens is not None else input_BS
        routes = split.cut(routes_BSLK) if routes_BSLK is not None else None
        return ids, routes, split.layout(document_ids_BS, rows, full, input_BS.device)


def _positions(
    shape_BS: torch.Size, device: torch.device, cache: KVCache | None, attention_mask_BS: Tensor | None, start: int
) -> tuple[Tensor, Tensor | None]:
    """``(positions, key_mask)``: ``[S]`` and None when every token is real; else per row ``[B, S]``
    (real tokens before + running count - 1) and the real-token mask of every attended position ``[B, L]``."""
    rows, width = shape_BS
    if attention_mask_BS is None and (cache is None or cache.key_mask is None):
        return torch.arange(start, start + width, device=device), None
    mask_BS = (
        attention_mask_BS.bool()
        if attention_mask_BS is not None
        else torch.ones((rows, width), dtype=torch.bool, device=device)
    )
    if cache is None:
        before_B, key_mask_BL = torch.zeros(rows, dtype=torch.int64, device=device), mask_BS
    else:
        real = cache.real_tokens()
        before_B = real if real is not None else torch.full((rows,), start, device=device)
        key_mask_BL = cache.write_mask(mask_BS)
    positions_BS = (before_B[:, None] + mask_BS.long().cumsum(dim=1) - 1).clamp_min(0)
    return positions_BS, key_mask_BL


class CausalLM(nn.Module, ABC):
    """A decoder with a language-model head: ``input_ids [B, S]`` -> ``logits [B, S, vocab]``."""

    base_model_prefix: ClassVar[str] = "model"
    model_type: ClassVar[str]
    lm_head: nn.Linear | None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.model_type != self.model_type:
            raise ValueError(f"{type(self).__name__} builds model_type {self.model_type!r}, got {config.model_type!r}")
        self.config = config
        layers = [
            DecoderLayer(config, self.build_mlp(config, i), i, self.build_attention(config, i))
            for i in range(config.num_hidden_layers)
        ]
        self.model = DecoderModel(config, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def build_attention(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The self-attention of layer ``layer_idx``: any module with :class:`Attention`'s forward (``[B, S, H]``
        in and out, with rope, cache, padding and packed-document arguments). Grouped-query by default."""
        return Attention(config, layer_idx)

    @abstractmethod
    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The feed-forward of layer ``layer_idx``, mapping ``[B, S, H]`` to ``[B, S, H]``."""

    @abstractmethod
    def default_plans(self) -> DefaultPlans:
        """This model's tp / ep / fsdp plans, keys as full paths (``model.layers.*.self_attn.q_proj``)."""

    def forward(
        self,
        input_ids_BS: Tensor,
        cache: KVCache | None = None,
        attention_mask_BS: Tensor | None = None,
        positions_B: Tensor | None = None,
        document_ids_BS: Tensor | None = None,
        routes_BSLK: Tensor | None = None,
    ) -> Tensor:
        """``logits [B, S, V]``; with ``positions_B``, only row ``b``'s position ``positions_B[b]``: ``[B, V]``
        (the head never sees the other positions). One call through the root module, as FSDP2 requires.
        ``document_ids [B, S]``: packed rows, each document attending only to itself (:mod:`.packing`).
        ``routes [B, S, L_moe, K]``: replayed expert ids of every sparse layer (:mod:`raymoe.models.moe.replay`)."""
        hidden_BSH: Tensor = self.model(input_ids_BS, cache, attention_mask_BS, document_ids_BS, routes_BSLK)
        if self.lm_head is None:  # a part of the model before the head: its hidden states go on to the next part
            return hidden_BSH
        if positions_B is not None:
            hidden_BSH = hidden_BSH[torch.arange(hidden_BSH.shape[0], device=hidden_BSH.device), positions_B]
        logits: Tensor = self.lm_head(hidden_BSH)
        return logits

    def new_cache(self, max_length: int) -> KVCache:
        """An empty KV cache for up to ``max_length`` tokens per row, one slot per decoder layer."""
        return KVCache(len(self.model.layers), max_length)

    def keep_part(self, layers: range, embedding: bool, head: bool) -> None:
        """Drop everything but decoder ``layers`` (and the embedding / the final norm and head when asked), in
        place: the part one pipeline stage runs. Kept parameters keep their names (``model.layers.5...``); the
        part takes hidden states ``[B, S, H]`` when it has no embedding and returns them when it has no head."""
        for index in range(len(self.model.layers)):
            if index not in layers:
                self.model.layers[index] = SkippedLayer()
        if not embedding:
            self.model.embed_tokens = None
        if not head:
            self.model.norm = None
            self.lm_head = None

    def kept_layers(self) -> list[int]:
        """Indices of the decoder layers this model (or part of it) runs."""
        return [i for i, layer in enumerate(self.model.layers) if not isinstance(layer, SkippedLayer)]

    @property
    def num_experts(self) -> int | None:
        """Routed experts per sparse layer; None for a dense model."""
        return self.config.moe.num_experts if self.config.moe is not None else None

    def sparse_layers(self) -> list[int]:
        """Indices of the layers whose feed-forward routes through experts."""
        return list(self.config.sparse_slots())

    @property
    def supports_tp_plan(self) -> bool:
        return bool(self.default_plans().tp)

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the head and the embedding share one parameter (re-done after loading)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hub_layout(self, available: Collection[str] | None = None) -> HubLayout:
        """Every parameter (a tied one once) -> the hub tensors it is made of; here each is its own name.

        ``available`` are the tensor names of the checkpoint being read: a family whose checkpoints
        come in several layouts (per-expert or fused, quantized or not) picks the one present.
        None (saving) asks for the layout raymoe writes. LoRA factors are not hub tensors (they live in a
        PEFT adapter file, :mod:`raymoe.checkpoint.adapter`); experts kept packed are their weights
        (:mod:`raymoe.models.moe.packed`: a save writes them dequantized).
        """
        packed = packed_companions(self)
        scales = {scales for _, scales in packed.values()}
        names = [packed[name][0] if name in packed else name for name, _ in self.named_parameters()]
        return {name: name for name in names if not is_adapter_name(name) and name not in scales}

    def is_ignored_hub_key(self, key: str) -> bool:
        """Hub tensors that are legitimately present yet not loaded."""
        # Old Llama checkpoints store RoPE frequencies; tied checkpoints may still store the head.
        return key.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and key == "lm_head.weight")

    @torch.no_grad()
    def init_weights(self) -> None:
        """Random initialisation as the hub models define it: normal(0, initializer_range), norms one, biases zero."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding | TopKRouter):
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear | TopKRouter) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx].zero_()
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            if isinstance(module, GroupedExperts):
                module.reset_parameters(std)
