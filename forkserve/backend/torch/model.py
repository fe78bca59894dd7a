"""The decoder forward (Llama / Mistral / Qwen2) over a flattened batch and paged KV.

One function serves every layout: for split items (the disaggregated layout, and split
sessions of the adaptive one) the k/v LoRA deltas are not added to K/V; their rank-r inputs
(x A_k, x A_v) go to the residual pool instead and the attention backend reconstructs K/V
on read. A batch is split when its metadata carries residual tables; merged items inside
it (``kv_merge_mask``) still get their delta. q/o/MLP LoRA apply normally everywhere. In a
selective-recompute layer (``recompute.py``) split items run as merged ones over their own
store. K/V are projected only for the rows that write them (``AttentionMetadata.base_writes``):
a row that reads base pages already written (the split form over a shared context) costs q,
its residual and attention, not a K/V projection written nowhere. A forward that folds
(``Fusions.folds``: ``fold_norms``, no LoRA, decode-sized) runs each RMSNorm inside the
projection that reads it and each residual add in the epilogue of o and down.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from forkserve.backend.torch.attention import AttentionBackend, AttentionMetadata
from forkserve.backend.torch.fused import Fusions, Normed
from forkserve.backend.torch.kv_pool import KVPool
from forkserve.backend.torch.lora import LoraStack
from forkserve.backend.torch.model_config import ModelConfig
from forkserve.backend.torch.recompute import own_view
from forkserve.backend.torch.rope import Rope
from forkserve.backend.torch.weights import ModelWeights


class CausalLM:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, lora: LoraStack | None,
                 attention: AttentionBackend, device: torch.device, fusions: Fusions) -> None:
        self.cfg, self.weights, self.lora, self.attention = cfg, weights, lora, attention
        self.fx = fusions
        self.rope = Rope(cfg.rope, cfg.head_dim, device)
        q, kv = cfg.q_size, cfg.kv_size
        self._qkv_slices = {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}
        i = cfg.intermediate_size
        self._gate_up_slices = {"gate": slice(0, i), "up": slice(i, 2 * i)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_slot: torch.Tensor,
                meta: AttentionMetadata, pool: KVPool, logits_indices: torch.Tensor,
                use_lora: bool) -> torch.Tensor:
        """input_ids/positions/token_slot [T] -> float32 logits [len(logits_indices), vocab]."""
        return self._run(input_ids, positions, token_slot, meta, pool, logits_indices, use_lora,
                         None)

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       token_slot: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                       logits_indices: torch.Tensor,
                       use_lora: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() plus the residual stream after every decoder layer: [T, layers, hidden]
        (before the final norm), for every token, not only the logits rows."""
        layers: list[torch.Tensor] = []
        logits = self._run(input_ids, positions, token_slot, meta, pool, logits_indices, use_lora,
                           layers)
        return logits, torch.stack(layers, dim=1)

    @torch.inference_mode()
    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, token_slot: torch.Tensor,
             meta: AttentionMetadata, pool: KVPool, logits_indices: torch.Tensor, use_lora: bool,
             layers_out: list[torch.Tensor] | None) -> torch.Tensor:
        w, fx, eps = self.weights, self.fx, self.cfg.rms_norm_eps
        lora = self.lora if use_lora else None
        x = F.embedding(input_ids, w.embed)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        masks = lora.group_masks(lora.token_mask(token_slot, x.dtype)) if lora is not None else {}
        split = meta.res_block_tables is not None
        # Folded (``Fusions.folds``): each norm runs inside the projection that reads it (h a
        # ``Normed``), each residual add in the epilogue of o and down.
        fold = fx.folds(x.shape[0], lora is not None)
        h: torch.Tensor | Normed = (Normed(x, w.layers[0].input_norm, eps) if fold
                                    else fx.rms_norm(x, w.layers[0].input_norm, eps))
        pool.tag_writes(meta.slot_mapping, token_slot)  # offset correction: each slot's writer
        rope_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # cos/sin of written rows
        for n, layer in enumerate(w.layers):
            # Selective recompute: in this layer the (all split) items keep merged K/V of their own.
            own = pool.own_layer(n) if split else None
            layer_split = split and own is None
            layer_meta = meta if own is None else own_view(meta)
            q, k, v, res = self._project(n, layer, h, (cos, sin), rope_rows, masks.get("qkv"), lora,
                                         layer_meta, layer_split)
            if lora is not None and meta.extra_rows is not None and "qkv" in lora.groups:
                self._write_extra_residuals(n, h, meta, pool, lora)
            b_k = lora.b_stack(n, "k") if lora is not None and layer_split else None
            b_v = lora.b_stack(n, "v") if lora is not None and layer_split else None
            attn = self.attention.forward(q, k, v, res.get("k"), res.get("v"),
                                          pool.layer(n) if own is None else own, b_k, b_v,
                                          layer_meta, self.rope)
            if fold:
                x = fx.linear_add(attn, layer.o, x)
                x = fx.linear_add(fx.norm_gate_up_silu(Normed(x, layer.post_norm, eps),
                                                       layer.gate_up), layer.down, x)
                if n + 1 < len(w.layers):
                    h = Normed(x, w.layers[n + 1].input_norm, eps)
                if layers_out is not None:
                    layers_out.append(x)
                continue
            o = fx.linear(attn, layer.o)
            if lora is not None and "o" in lora.groups:
                lora.expand_(n, "o", lora.shrink(n, "o", attn, masks["o"]), o)
            x, h = fx.add_rms_norm(x, o, layer.post_norm, eps)
            if lora is not None and "gate_up" in lora.groups:
                gate_up = fx.linear(h, layer.gate_up)
                shrunk = lora.shrink(n, "gate_up", h, masks["gate_up"])
                for t in lora.groups["gate_up"]:
                    lora.expand_(n, t, lora.part("gate_up", t, shrunk),
                                 gate_up[:, self._gate_up_slices[t]])
                act = fx.silu_mul(gate_up)
            else:
                act = fx.gate_up_silu(h, layer.gate_up)
            down = fx.linear(act, layer.down)
            if lora is not None and "down" in lora.groups:
                lora.expand_(n, "down", lora.shrink(n, "down", act, masks["down"]), down)
            if n + 1 < len(w.layers):
                x, h = fx.add_rms_norm(x, down, w.layers[n + 1].input_norm, eps)
            else:
                x = x + down
            if layers_out is not None:
                layers_out.append(x)
        if fold:
            return fx.norm_linear(Normed(x[logits_indices], w.final_norm, eps), w.lm_head).float()
        x = fx.rms_norm(x[logits_indices], w.final_norm, eps)
        return fx.linear(x, w.lm_head).float()

    def _project(self, n: int, layer, h: torch.Tensor | Normed,
                 rope: tuple[torch.Tensor, torch.Tensor],
                 rope_rows: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 mask: torch.Tensor | None, lora: LoraStack | None, meta: AttentionMetadata,
                 layer_split: bool) -> tuple[torch.Tensor, torch.Tensor | None,
                                             torch.Tensor | None, dict[str, torch.Tensor]]:
        """q [T, Hq, D] of every row; K (with RoPE) and V [W, Hkv, D] of the W rows that write
        base K/V (``meta.base_writes``; every row where None, and None where no row does);
        the split items' residual rows (k, v: [T, r_max]).

        A row that reads base pages already written (another agent's shared context, a
        partial prefix hit) needs no K/V: attention reads its keys from the pages. Where at
        most half the rows write, K/V are projected from those rows alone (the K/V share of
        the qkv product, its k/v LoRA expands and K's RoPE shrink to them); otherwise the
        whole product runs and the writing rows are taken from it. ``rope_rows``: the forward's
        cos/sin of the writing rows, gathered at the first layer that needs them. ``h`` a
        ``Normed`` (a folding forward, no LoRA): the whole product folds the norm; the
        compact one takes the normed rows."""
        cfg, fx = self.cfg, self.fx
        cos, sin = rope
        rows = None if meta.base_writes is None else meta.base_writes[0]
        tokens = (h.x if isinstance(h, Normed) else h).shape[0]
        compact = rows is not None and 2 * rows.shape[0] <= tokens
        if compact and isinstance(h, Normed):
            h = fx.value(h)
        kv = None
        if compact:
            q_cols, kv_cols = slice(0, cfg.q_size), slice(cfg.q_size, None)
            bias = layer.qkv_bias
            qkv = fx.linear(h, layer.qkv[q_cols], None if bias is None else bias[q_cols])
            if rows.shape[0]:
                kv = fx.linear(h.index_select(0, rows), layer.qkv[kv_cols],
                               None if bias is None else bias[kv_cols])
        elif isinstance(h, Normed):
            qkv = fx.norm_linear(h, layer.qkv, layer.qkv_bias)
        else:
            qkv = fx.linear(h, layer.qkv, layer.qkv_bias)
        res: dict[str, torch.Tensor] = {}
        if lora is not None and "qkv" in lora.groups:
            shrunk = lora.shrink(n, "qkv", h, mask)
            if layer_split:
                res = lora.residuals(shrunk)
            for t in lora.groups["qkv"]:
                part = lora.part("qkv", t, shrunk)
                if t == "q":
                    lora.expand_(n, t, part, qkv[:, self._qkv_slices[t]])
                    continue
                if layer_split:  # split items' k/v delta is their residual; merged ones get it
                    if meta.kv_merge_mask is None:
                        continue
                    part = part * meta.kv_merge_mask
                if not compact:
                    lora.expand_(n, t, part, qkv[:, self._qkv_slices[t]])
                elif kv is not None:
                    at = slice(0, cfg.kv_size) if t == "k" else slice(cfg.kv_size, None)
                    lora.expand_(n, t, part.index_select(0, rows), kv[:, at])
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if compact:
            q = fx.rope_qk(qkv, cos, sin, heads, 0, dim)
            if kv is None:
                return q, None, None, res
            if id(rows) not in rope_rows:  # the rows tensor lives as long as the forward
                rope_rows[id(rows)] = (cos.index_select(0, rows), sin.index_select(0, rows))
            k = fx.rope_qk(kv, *rope_rows[id(rows)], kv_heads, 0, dim)
            return q, k, kv[:, cfg.kv_size:].view(-1, kv_heads, dim), res
        # q and k are adjacent in qkv: one RoPE over both heads sets.
        qk = fx.rope_qk(qkv, cos, sin, heads, kv_heads, dim)
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, self._qkv_slices["v"]].view(tokens, kv_heads, dim)
        if rows is not None:
            k, v = k.index_select(0, rows), v.index_select(0, rows)
        return q, k, v, res

    @staticmethod
    def _write_extra_residuals(layer: int, h: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                               lora: LoraStack) -> None:
        """base_activations: other adapters' x A_k, x A_v from this pass's activations ``h``."""
        kv = pool.layer(layer)
        parts = lora.slot_residuals(layer, h, meta.extra_rows, meta.extra_token_slot)
        for target, part in parts.items():
            dst = kv.k_res if target == "k" else kv.v_res
            dst.view(-1, dst.shape[-1]).index_copy_(0, meta.extra_res_slot_mapping, part)
