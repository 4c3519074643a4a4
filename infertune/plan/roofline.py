"""Roofline model: prefill and decode step times from bytes moved and FLOPs, per card of a tensor-parallel group.

    step time = max(bytes / (bandwidth x eff_bw), flops / (peak x eff_compute)) + tensor-parallel all-reduce time

Decode step of `batch` sequences at `context` tokens:
  bytes = weights streamed once (every layer, final norm, lm_head; not an untied input embedding, which is a row
          lookup; in a MoE layer only the experts the batch touches, E (1 - (1 - k/E)^batch) in expectation) + the
          batch's KV cache read (+ the new token's KV written)
  flops = 2 x (layer matmul weights a token uses + lm_head) x batch + attention x (tokens attended, summed over
          layers) x batch, where attention per attended token and layer is 4 x heads x head_dim (QK^T and PV), and
          for MLA's absorbed decode 2 x heads x ((kv_lora_rank + qk_rope_head_dim) + kv_lora_rank): scores against
          the cached latent row, the output in latent space (W_UK and W_UV count with the layer's matmuls)
Prefill of `batch` prompts of `prompt_len` tokens: the weights the batch's tokens touch, once; 2 x layer matmul
weights x tokens, the lm_head for the last position of each prompt only, causal attention (i attends to
min(i, window) tokens; MLA decompresses, 2 x heads x (qk_nope + qk_rope + v_head) a pair) and the prompt's KV
written. With --tp N every term is divided over N cards (the routed experts too: expert parallel) and each layer
adds two all-reduces of batch x hidden x 2 bytes (ring: 2 (N-1) / N of it crosses each card's link, at half its
bidirectional bandwidth); link latency and MoE all-to-all traffic are not modelled.

Efficiency factors say how much of the datasheet peak a real engine reaches. Defaults come from the seeds:
82% of HBM bandwidth once buffers are pre-allocated and reused (deepseek-qwen-on-910b.txt), and "most customers
do not reach 50% of theoretical peak" compute (ascend-910b-tuning-2.16x.txt). A device measured on this machine
uses 1.0 for both: its probes already report achieved numbers. `calibrate_*` replace a factor from one measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from infertune.plan.catalog import Device
from infertune.plan.memory import (
    KVFormat,
    ModelSpec,
    WeightFormat,
    check_tensor_parallel,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_groups,
    kv_shard_fraction,
    kv_token_layers,
    weight_breakdown,
)

BATCH_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Efficiency:
    bandwidth: float = 0.82
    compute: float = 0.50
    source: str = "defaults (seeds: 82% of HBM bandwidth with pre-allocated buffers; under 50% of peak compute)"

    def __post_init__(self) -> None:
        for name in ("bandwidth", "compute"):
            v = getattr(self, name)
            if not 0 < v <= 1.5:  # a little above 1 is allowed: a calibration can beat a pessimistic spec
                raise ValueError(f"{name} efficiency must be in (0, 1.5] (got {v})")


MEASURED = Efficiency(1.0, 1.0, "1.0: the local device's probes measure achieved bandwidth and matmul FLOP/s")


def default_efficiency(device: Device) -> Efficiency:
    return MEASURED if device.measured else Efficiency()


@dataclass(frozen=True)
class StepEstimate:
    tokens: int  # tokens produced (decode) or processed (prefill) by the step, all sequences
    bytes_per_card: float
    flops_per_card: float
    memory_time_s: float
    compute_time_s: float
    comm_time_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_time_s, self.compute_time_s) + self.comm_time_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_time_s >= self.compute_time_s else "compute"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time_s

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "bytes_per_card": self.bytes_per_card,
            "flops_per_card": self.flops_per_card,
            "memory_time_s": self.memory_time_s,
            "compute_time_s": self.compute_time_s,
            "comm_time_s": self.comm_time_s,
            "time_s": self.time_s,
            "bound": self.bound,
            "tokens_per_s": self.tokens_per_s,
        }


def causal_pairs(length: int, window: int | None) -> int:
    """Sum over positions i = 1..length of the tokens position i attends to: min(i, window)."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


class Roofline:
    def __init__(
        self,
        spec: ModelSpec,
        device: Device,
        weight_format: WeightFormat = WeightFormat(),
        kv_format: KVFormat = KVFormat(),
        tp: int = 1,
        efficiency: Efficiency | None = None,
    ) -> None:
        check_tensor_parallel(spec, tp)
        self.spec, self.device, self.fmt, self.kv, self.tp = spec, device, weight_format, kv_format, tp
        self.eff = efficiency or default_efficiency(device)
        self.weights = weight_breakdown(spec, weight_format)
        self.kv_fraction = kv_shard_fraction(spec, tp)
        a = spec.arch
        if a.mla is not None:  # per attended token: absorbed at decode, decompressed at prefill
            m = a.mla
            self.attn_flops_per_token_layer = 2 * a.num_attention_heads * (m.cache_width + m.kv_lora_rank)
            qk_v = m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim
            self.prefill_attn_flops_per_pair = 2 * a.num_attention_heads * qk_v
        else:
            self.attn_flops_per_token_layer = 4 * a.num_attention_heads * a.head_dim  # QK^T and PV
            self.prefill_attn_flops_per_pair = self.attn_flops_per_token_layer

    def weight_bytes_per_card(self, tokens: int) -> float:
        """Weight bytes each card reads in a step of `tokens` tokens (replicated parts whole, the rest 1/tp)."""
        replicated = self.weights.replicated_bytes
        return (self.weights.weight_bytes_read(tokens) - replicated) / self.tp + replicated

    # -- pieces -----------------------------------------------------------------------------------------

    def _times(self, tokens: int, nbytes: float, flops: float, allreduce_rows: int) -> StepEstimate:
        d, e = self.device, self.eff
        comm = 0.0
        link = d.interconnect.bandwidth_bytes_per_s if d.interconnect else None
        if self.tp > 1 and link:
            a = self.spec.arch
            per_card = 2 * a.num_hidden_layers * 2 * (self.tp - 1) / self.tp * allreduce_rows * a.hidden_size * 2
            comm = per_card / (link / 2)
        return StepEstimate(
            tokens,
            nbytes,
            flops,
            nbytes / (d.memory_bandwidth_bytes_per_s * e.bandwidth),
            flops / (d.peak_flops_16bit * e.compute),
            comm,
        )

    def decode_step(self, batch: int, context: int) -> StepEstimate:
        """One decode step of `batch` sequences, each attending to `context` tokens (including the new one)."""
        w = self.weights
        kv_read = batch * kv_bytes_per_sequence(self.spec, context, self.kv, held=False) * self.kv_fraction
        kv_write = batch * kv_bytes_per_token(self.spec, self.kv) * self.kv_fraction
        matmul = 2 * (w.params_active_linear_weights + w.lm_head_matmul_params) * batch
        attention = self.attn_flops_per_token_layer * kv_token_layers(self.spec, context, self.kv) * batch
        return self._times(
            batch,
            self.weight_bytes_per_card(batch) + kv_read + kv_write,
            (matmul + attention) / self.tp,
            allreduce_rows=batch,
        )

    def prefill(self, prompt_len: int, batch: int = 1) -> StepEstimate:
        """Prefill of `batch` prompts of `prompt_len` tokens in one step (logits for the last position only)."""
        s, w = self.spec, self.weights
        tokens = prompt_len * batch
        # (each layer within its window: the model's, or a compression policy's window rule)
        pairs = sum(len(g.layers) * causal_pairs(prompt_len, g.window) for g in kv_groups(s, prompt_len, self.kv))
        flops = (
            2 * w.params_active_linear_weights * tokens
            + 2 * w.lm_head_matmul_params * batch
            + self.prefill_attn_flops_per_pair * pairs * batch
        )
        # (every prompt token's K / V is written before any press runs on them: the window rules only)
        unpressed = replace(self.kv, pressed=False)
        kv_write = batch * kv_bytes_per_sequence(s, prompt_len, unpressed, held=False) * self.kv_fraction
        return self._times(
            tokens, self.weight_bytes_per_card(tokens) + kv_write, flops / self.tp, allreduce_rows=tokens
        )

    # -- workload ---------------------------------------------------------------------------------------

    def generation(self, input_len: int, output_len: int, batch: int) -> dict:
        """`batch` requests of input_len + output_len tokens, prefilled together, then decoded together.

        TTFT is the prefill (its logits give the first token); each later token costs a decode step at the
        average context input_len + output_len / 2 (the cost is linear in context, so that is exact for the sum).
        """
        prefill = self.prefill(input_len, batch)
        step = self.decode_step(batch, input_len + max(1, output_len // 2))
        total = prefill.time_s + (output_len - 1) * step.time_s
        return {
            "batch": batch,
            "ttft_s": prefill.time_s,
            "tpot_s": step.time_s,
            "decode_bound": step.bound,
            "decode_tokens_per_s": step.tokens_per_s,
            "request_latency_s": total,
            "output_tokens_per_s": batch * output_len / total,
        }

    def prefill_requests_per_s(self, input_len: int, chunk_tokens: int = 2048) -> float:
        """Requests a prefill instance finishes per second, packing prompts into steps of ~chunk_tokens."""
        k = max(1, chunk_tokens // input_len)
        return k / self.prefill(input_len, k).time_s

    def decode_requests_per_s(self, input_len: int, output_len: int, batch: int) -> float:
        """Requests a decode instance finishes per second at `batch` concurrent sequences (output_len - 1 steps)."""
        step = self.decode_step(batch, input_len + max(1, output_len // 2))
        return batch / (step.time_s * max(1, output_len - 1))


def _calibrated(roof: Roofline, measured_step_s: float, ideal: StepEstimate, what: str) -> Efficiency:
    if measured_step_s <= ideal.comm_time_s:
        raise ValueError(f"the measured {what} time is shorter than the modelled communication time alone")
    busy = measured_step_s - ideal.comm_time_s
    ratio = (ideal.memory_time_s if ideal.bound == "memory" else ideal.compute_time_s) / busy
    if ratio > 1.5:
        raise ValueError(
            f"the measured {what} is {ratio:.1f}x faster than {roof.device.name}'s peak "
            f"{'bandwidth' if ideal.bound == 'memory' else 'FLOP/s'} allows; check the device figures, "
            "--batch and the input / output lengths it was measured at"
        )
    if ideal.bound == "memory":
        return replace(
            roof.eff,
            bandwidth=round(ideal.memory_time_s / busy, 4),
            source=f"bandwidth calibrated from a measured {what} ({ideal.memory_time_s / busy:.0%} of peak)",
        )
    return replace(
        roof.eff,
        compute=round(ideal.compute_time_s / busy, 4),
        source=f"compute calibrated from a measured {what} ({ideal.compute_time_s / busy:.0%} of peak)",
    )


def _ideal(roof: Roofline) -> Roofline:
    return Roofline(roof.spec, roof.device, roof.fmt, roof.kv, roof.tp, Efficiency(1.0, 1.0, "ideal"))


def calibrate_decode(roof: Roofline, measured_tokens_per_s: float, batch: int, context: int) -> Efficiency:
    """Efficiency that makes the model reproduce a measured decode throughput (the bound side is the one set)."""
    if measured_tokens_per_s <= 0:
        raise ValueError(f"measured decode tokens/s must be positive (got {measured_tokens_per_s})")
    ideal = _ideal(roof).decode_step(batch, context)
    return _calibrated(
        roof, batch / measured_tokens_per_s, ideal, f"decode of {measured_tokens_per_s:g} tok/s at batch {batch}"
    )


def calibrate_prefill(roof: Roofline, measured_tokens_per_s: float, prompt_len: int, batch: int = 1) -> Efficiency:
    if measured_tokens_per_s <= 0:
        raise ValueError(f"measured prefill tokens/s must be positive (got {measured_tokens_per_s})")
    ideal = _ideal(roof).prefill(prompt_len, batch)
    return _calibrated(
        roof, prompt_len * batch / measured_tokens_per_s, ideal, f"prefill of {measured_tokens_per_s:g} tok/s"
    )
