"""Knowledge distillation and from-scratch training on one shared data pipeline.

* ``loss.kd_loss``: alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(student, labels).
* ``data``: text / directory / JSONL corpus -> teacher-tokenized packed windows, hash-based held-out split.
* ``trainer``: the training loop (AdamW, warm-up + cosine, checkpoints, resume, HF-format output, report).
* ``command``: ``infertune distill`` (``add_arguments`` / ``run``) and ``infertune train`` (``TRAIN``).
"""

from infertune.distill.loss import kd_loss, kd_loss_parts

__all__ = ["kd_loss", "kd_loss_parts"]
