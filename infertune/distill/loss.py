"""Knowledge-distillation loss (Hinton et al. 2015 form, as specified in issue 8).

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

Both terms are means over the tokens whose label is not ``ignore_index`` (padding): the KL is summed over the
vocabulary for each token, then averaged over those tokens; the cross-entropy uses the raw (T = 1) student
logits. ``labels`` are aligned with the logits (already shifted: ``labels[..., i]`` is the target of position i).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def kd_loss_parts(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 4.0,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean per-token KL at temperature T, without the T^2 factor; mean cross-entropy). KL is 0 without a teacher."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = student_logits.size(-1)
    s = student_logits.reshape(-1, vocab).float()
    y = labels.reshape(-1)
    if y.numel() != s.size(0):
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(student_logits.shape)}")
    mask = y != ignore_index
    n = mask.sum()
    if int(n) == 0:
        zero = s.sum() * 0.0
        return zero, zero
    ce = F.cross_entropy(s, y, ignore_index=ignore_index, reduction="sum") / n
    if teacher_logits is None:
        return s.new_zeros(()), ce
    t = teacher_logits.reshape(-1, teacher_logits.size(-1)).float()
    if t.size(-1) != vocab:
        raise ValueError(f"teacher vocabulary {t.size(-1)} != student vocabulary {vocab}")
    log_p_t = F.log_softmax(t[mask] / temperature, dim=-1)
    log_p_s = F.log_softmax(s[mask] / temperature, dim=-1)
    kl = (log_p_t.exp() * (log_p_t - log_p_s)).sum() / n
    return kl, ce


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    labels: torch.Tensor,
    temperature: float = 4.0,
    alpha: float = 0.7,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T)) + (1 - alpha) * CE(student, labels).

    Mean over non-ignored tokens. ``teacher_logits`` may be None only when alpha == 0 (plain training).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if teacher_logits is None and alpha != 0.0:
        raise ValueError("alpha > 0 needs teacher logits")
    kl, ce = kd_loss_parts(student_logits, teacher_logits if alpha != 0.0 else None, labels, temperature, ignore_index)
    if alpha == 0.0:
        return ce
    if alpha == 1.0:
        return temperature**2 * kl
    return alpha * temperature**2 * kl + (1.0 - alpha) * ce
