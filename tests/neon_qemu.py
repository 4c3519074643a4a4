"""The NEON kernels (infertune/kernels/csrc/arm/neon) on this x86 machine: built for AArch64 with Debian's
gcc-aarch64-linux-gnu and run under qemu-user, behind the same entry points as a ctypes library, so that
kernels/cpu.py's bindings (and every oracle of tests/test_kernels.py) run on them unchanged.

`QemuNeonLib` stands where a `ctypes.CDLL` of the kernels would: each `it_*` call copies its input buffers out of
this process's memory (the pointers cpu.py passes), runs tests/csrc/neon_harness.c under qemu-aarch64, and copies
the output buffer back. Slow (a process per call) and for correctness only: nothing here measures Arm speed."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "infertune" / "kernels" / "csrc"
HARNESS = Path(__file__).resolve().parent / "csrc" / "neon_harness.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
# The library's flags (kernels/cpu.py VARIANTS["neon"]), for a static test binary instead of a shared library
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wextra", "-Werror", "-march=armv8-a"]


def missing_tools() -> str | None:
    absent = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    return f"{' and '.join(absent)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)" if absent else None


def build_harness(out_dir: Path) -> Path:
    exe = out_dir / "neon_harness"
    cmd = [CROSS_CC, *FLAGS, "-static", f"-I{CSRC}", str(HARNESS), "-o", str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    # (the static libgomp's dlopen warning is the linker's, not ours; -Werror holds our code to no warnings)
    if r.returncode != 0:
        raise RuntimeError(f"cross-compiling the NEON kernels failed:\n{r.stderr}")
    return exe


class QemuNeonLib:
    """A stand-in for the kernels' ctypes library: the NEON entry points, each run under qemu-aarch64."""

    def __init__(self, harness: Path) -> None:
        self.harness = harness
        self.calls = 0

    def _run(self, op: str, scalars: list, buffers: list[tuple[int | None, int]]) -> str:
        """buffers: (pointer or None, bytes); the last is the output (read first, written back after). Returns what
        the call printed (an entry point's return code, where it has one)."""
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for i, (ptr, size) in enumerate(buffers):
                if not ptr:
                    paths.append("-")
                    continue
                p = Path(tmp) / f"b{i}"
                p.write_bytes(ctypes.string_at(ptr, size))
                paths.append(str(p))
            cmd = [QEMU, str(self.harness), op, *map(str, scalars), *paths]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{op} under qemu failed ({r.returncode}): {r.stderr}")
            out = Path(paths[-1]).read_bytes()
            ctypes.memmove(buffers[-1][0], out, len(out))
        self.calls += 1
        return r.stdout

    def _abi(self) -> list[int]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "abi"
            r = subprocess.run(
                [QEMU, str(self.harness), "it_abi", str(out)], capture_output=True, text=True, timeout=60
            )
            if r.returncode != 0:
                raise RuntimeError(f"it_abi under qemu failed: {r.stderr}")
            raw = out.read_bytes()
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    @property
    def it_abi(self):
        return _Fn(lambda: self._abi()[0])

    @property
    def it_struct_sizes(self):
        def sizes(out, n):
            v = self._abi()
            for i in range(min(n, v[1])):
                out[i] = v[2 + i]
            return v[1]

        return _Fn(sizes)

    # the signatures of csrc/arm/neon (the same as the x86 libraries'); nthreads is the harness's own (2)
    def it_linear_bf16(self, x, ldx, w, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k * 2), (bias, n * 2), (y, ((m - 1) * ldy + n) * 2)]
        self._run("it_linear_bf16", [ldx, ldy, m, n, k], bufs)

    def it_linear_bf16_gemv(self, x, ldx, w, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k * 2), (bias, n * 2), (y, ((m - 1) * ldy + n) * 2)]
        self._run("it_linear_bf16_gemv", [ldx, ldy, m, n, k], bufs)

    def it_linear_bf16_gemm_fma(self, x, ldx, w, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k * 2), (bias, n * 2), (y, ((m - 1) * ldy + n) * 2)]
        self._run("it_linear_bf16_gemm_fma", [ldx, ldy, m, n, k], bufs)
        return 0

    def it_gemm_rows_fma(self, rows):
        """The library's default (each call is a fresh process: a row count set here would not last)."""
        if rows > 0:
            raise ValueError("under qemu every call is a new process: it_gemm_rows_fma cannot be set here")
        return self._int64_op("it_gemm_rows_fma")

    def _int64_op(self, op: str, *args: int) -> int:
        """An op of the harness that writes one int64 (a library's constant or default, or a size of its args)."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "value"
            cmd = [QEMU, str(self.harness), op, *map(str, args), str(out)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                raise RuntimeError(f"{op} under qemu failed: {r.stderr}")
            return int.from_bytes(out.read_bytes(), "little", signed=True)

    def it_moe_experts_ws_bytes(self, t, k, e, h, i, nthreads):
        return self._int64_op("it_moe_experts_ws_bytes", t, k, e, h, i, nthreads)

    def it_moe_max_experts(self):
        return self._int64_op("it_moe_max_experts")

    # The fused step: its structs and every buffer they point at go over in one blob (pointers as offsets into it,
    # _StepBlob), and the buffers the step writes (x, each layer's cache, the stats) come back.
    def it_decode_workspace_bytes(self, model, t, max_ctx):
        blob = _StepBlob()
        m = _copy(model)
        m.cos_sin = None
        return blob.run(self, "it_decode_workspace_bytes", blob.add(bytes(m)), 0, 0, 0, 0, t, max_ctx)

    def it_decode_layers(self, model, layers, step, x):
        from infertune.kernels import cpu

        blob, m, st = _StepBlob(), _copy(model), _copy(step)
        t, d, hkv = st.T, m.head_dim, m.n_kv_heads
        positions = (ctypes.c_int64 * t).from_address(st.positions)
        table = (max(positions) + 1) * (m.mla_rope if m.mla_rank else d) * 4  # (latent attention: rope dims)
        m.cos_sin = blob.buf(m.cos_sin, table)

        def ship(lin, count: int = 1) -> None:  # a linear's buffers into the blob (count: stacked experts)
            n, k = lin.N * count, lin.K
            if lin.kind == 4:  # W8A8: the packed words, fp32 scales [N], zero: the static activation scale [1] or NULL
                w_bytes, s_bytes, z_bytes = count * self._w8a8_bytes(lin.N, k), n * 4, 4
            else:
                w_bytes = {0: n * k * 2, 1: n * k, 2: n * k // 2}[lin.kind]
                s_bytes = n * (4 if lin.scale_is_f32 else 2) if lin.kind == 1 else n * (k // max(lin.group, 1)) * 4
                z_bytes = s_bytes
            lin.w, lin.bias = blob.buf(lin.w, w_bytes), blob.buf(lin.bias, n * 2)
            lin.scale, lin.zero = blob.buf(lin.scale, s_bytes), blob.buf(lin.zero, z_bytes)

        copies = (cpu.ItLayer * m.n_layers)()
        caches: dict[int, int] = {}  # (layers of different KV cache groups share a cache tensor: one copy of it)
        for c, layer in zip(copies, layers[: m.n_layers]):
            ctypes.pointer(c)[0] = layer
            w = 4 if m.norm_f32 else 2  # (Gemma's norms: fp32 factors)
            for name in ("input_norm", "post_norm", "pre_ff_norm", "post_ff_norm"):
                setattr(c, name, blob.buf(getattr(c, name), m.hidden * w))
            if c.moe:  # a MoE layer's description: its router, the stacked experts, the shared expert
                e = cpu.ItMoeLayer.from_buffer_copy(cpu.ItMoeLayer.from_address(c.moe))
                experts, hidden = e.rule.num_experts, m.hidden
                for lin in (e.gate_up, e.down):
                    ship(lin, e.local_experts or experts)
                ship(e.shared_gate_up)
                ship(e.shared_down)
                e.router, e.router_f32 = (
                    blob.buf(e.router, experts * hidden * 2),
                    blob.buf(e.router_f32, experts * hidden * 4),
                )
                e.bias, e.shared_gate = blob.buf(e.bias, experts * 4), blob.buf(e.shared_gate, hidden * 2)
                c.moe = blob.add(bytes(e))
            c.q_norm, c.k_norm = blob.buf(c.q_norm, d * w), blob.buf(c.k_norm, d * w)
            c.cos_sin = blob.buf(c.cos_sin, table)
            row = d + 4 if m.kv_int8 else d * 2
            planes = 1 if c.mla else 2  # (latent attention: one row a token)
            if c.kv_cache not in caches:
                caches[c.kv_cache] = blob.buf(c.kv_cache, planes * m.num_blocks * m.block_size * hkv * row, back=True)
            c.kv_cache = caches[c.kv_cache]
            for name in ("qkv", "o", "gate_up", "down"):
                ship(getattr(c, name))
            if c.mla:  # the latent attention's description, its linears, norms and kv_b_proj
                a = cpu.ItMlaLayer.from_buffer_copy(cpu.ItMlaLayer.from_address(c.mla))
                for lin in (a.q_a, a.q_b, a.kv_a):
                    ship(lin)
                a.q_a_norm, a.kv_a_norm = blob.buf(a.q_a_norm, m.mla_q_rank * 2), blob.buf(a.kv_a_norm, m.mla_rank * 2)
                a.kv_up = blob.buf(a.kv_up, m.n_heads * (m.mla_nope + m.mla_v) * m.mla_rank * 2)
                c.mla = blob.add(bytes(a))
        st.positions, st.slots = blob.buf(st.positions, t * 8), blob.buf(st.slots, t * 8)
        st.block_tables = blob.buf(st.block_tables, t * st.max_blocks * 8)
        for g in range(st.n_groups):  # KV cache groups: each one's slots and block tables
            st.group_slots[g] = blob.buf(st.group_slots[g], t * 8)
            st.group_tables[g] = blob.buf(st.group_tables[g], t * st.max_blocks * 8)
        st.context_lens, st.out_rows = blob.buf(st.context_lens, t * 8), blob.buf(st.out_rows, st.n_out * 8)
        st.stats = blob.buf(st.stats, ctypes.sizeof(cpu.ItStepStats), back=True)
        # MoE: the router logits a hand-back leaves (fp32 wide), the caller's routing when resuming, the expert load
        experts, k = max(m.moe_experts, 1), m.moe_top_k
        st.router_logits = blob.buf(st.router_logits, t * experts * 4, back=True)
        st.route_weights = blob.buf(st.route_weights, st.route_rows * k * 4)
        st.route_ids = blob.buf(st.route_ids, st.route_rows * k * 8)
        st.tied_rows = blob.buf(st.tied_rows, t * 8, back=True)
        st.expert_load = blob.buf(st.expert_load, m.n_layers * experts * 8, back=True)
        # (a MoE model's workspace both ways: the rows a hand-back did not tie keep their routing in it until the
        # resuming call; else the harness allocates work_bytes)
        st.work = blob.buf(st.work, st.work_bytes, back=True) if m.moe_experts > 0 else None
        offs = blob.add(bytes(m)), blob.add(bytes(copies)), blob.add(bytes(st))
        x_off = blob.buf(x, t * m.hidden * 2, back=True)
        rc = blob.run(self, "it_decode_layers", *offs, x_off, m.n_layers, t, 0)
        # (a hand-back's layer and rows, in the caller's step)
        done = cpu.ItStep.from_buffer_copy(blob.out[offs[2] : offs[2] + ctypes.sizeof(cpu.ItStep)])
        orig = getattr(step, "_obj", step)
        orig.handed_back, orig.route_rows = done.handed_back, done.route_rows
        return rc

    def it_linear_w8(self, x, ldx, w, scale, scale_is_f32, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k), (scale, n * (4 if scale_is_f32 else 2)), (bias, n * 2)]
        self._run("it_linear_w8", [scale_is_f32, ldx, ldy, m, n, k], [*bufs, (y, ((m - 1) * ldy + n) * 2)])

    def it_linear_w4(self, x, ldx, w, scale, zero, gs, bias, y, ldy, m, n, k, nthreads):
        g = n * (k // gs) * 4
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k // 2), (scale, g), (zero, g), (bias, n * 2)]
        self._run("it_linear_w4", [gs, ldx, ldy, m, n, k], [*bufs, (y, ((m - 1) * ldy + n) * 2)])

    def it_dequant_w8(self, q, scale, scale_is_f32, out, n, k, nthreads):
        bufs = [(q, n * k), (scale, n * (4 if scale_is_f32 else 2)), (out, n * k * 2)]
        self._run("it_dequant_w8", [scale_is_f32, n, k], bufs)

    def it_dequant_w4(self, packed, scale, zero, gs, out, n, k, nthreads):
        g = n * (k // gs) * 4
        self._run("it_dequant_w4", [gs, n, k], [(packed, n * k // 2), (scale, g), (zero, g), (out, n * k * 2)])

    def it_argmax_rows(self, x, rows, n, ld, out, nthreads):
        self._run("it_argmax_rows", [rows, n, ld], [(x, ((rows - 1) * ld + n) * 4), (out, rows * 8)])

    def it_argmax_rows_bf16(self, x, rows, n, ld, out, nthreads):
        self._run("it_argmax_rows_bf16", [rows, n, ld], [(x, ((rows - 1) * ld + n) * 2), (out, rows * 8)])

    def it_rmsnorm_mt(self, x, w, out, t, h, eps, nthreads):
        self._run("it_rmsnorm_mt", [t, h, repr(float(eps))], [(x, t * h * 2), (w, h * 2), (out, t * h * 2)])

    def it_silu_mul(self, gu, act, t, i, nthreads):
        self._run("it_silu_mul", [t, i], [(gu, t * 2 * i * 2), (act, t * i * 2)])

    def it_gelu_mul(self, gu, act, t, i, nthreads):
        self._run("it_gelu_mul", [t, i], [(gu, t * 2 * i * 2), (act, t * i * 2)])

    def it_rmsnorm_f32w(self, x, f, out, t, h, eps, nthreads):
        self._run("it_rmsnorm_f32w", [t, h, repr(float(eps))], [(x, t * h * 2), (f, h * 4), (out, t * h * 2)])

    # W8A8 (csrc/arm/neon/gemm_i8.c): the packed weight is i8_packed_words int32 words, [ceil(N / 16), Kp / 4, 16]
    def it_w8a8_block(self):
        return self._int64_op("it_w8a8_block")

    def _w8a8_bytes(self, n: int, k: int) -> int:
        from infertune.kernels import cpu

        a, b, c = cpu.w8a8_packed_shape(n, k, self)
        return a * b * c * 4

    def it_pack_w8a8(self, q, n, k, out, nthreads):
        return int(self._run("it_pack_w8a8", [n, k], [(q, n * k), (out, self._w8a8_bytes(n, k))]))

    def it_unpack_w8a8(self, packed, n, k, q):
        self._run("it_unpack_w8a8", [n, k], [(packed, self._w8a8_bytes(n, k)), (q, n * k)])

    def it_linear_w8a8(self, x, ldx, w, scale, static, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, self._w8a8_bytes(n, k)), (scale, n * 4), (static, 4), (bias, n * 2)]
        return int(self._run("it_linear_w8a8", [ldx, ldy, m, n, k], [*bufs, (y, ((m - 1) * ldy + n) * 2)]))

    def it_rotary(self, qk, ld, t, heads, d, cs, ld_cs, nthreads):
        bufs = [(cs, ((t - 1) * ld_cs + d) * 4), (qk, ((t - 1) * ld + heads * d) * 2)]
        self._run("it_rotary", [ld, t, heads, d, ld_cs], bufs)


def _copy(ref):
    """A copy of the struct a ctypes.byref() (or the struct itself) refers to."""
    obj = getattr(ref, "_obj", ref)
    return type(obj).from_buffer_copy(obj)


class _StepBlob:
    """One file for the harness's fused-step ops: a header of 8 int64, then the structs and buffers, 64-byte aligned."""

    def __init__(self) -> None:
        self.data = bytearray(64)
        self.back: list[tuple[int, int, int]] = []  # (offset, pointer here, bytes) to copy back after the call

    def add(self, raw: bytes) -> int:
        self.data += bytes(-len(self.data) % 64)
        off = len(self.data)
        self.data += raw
        return off

    def buf(self, ptr, nbytes: int, back: bool = False) -> int | None:
        if not ptr:
            return None
        off = self.add(ctypes.string_at(ptr, nbytes))
        if back:
            self.back.append((off, ptr, nbytes))
        return off

    def run(self, lib: QemuNeonLib, op: str, *header: int) -> int:
        assert len(header) == 7  # (the eighth: the return code, from the harness)
        self.data[:64] = b"".join(int(v).to_bytes(8, "little", signed=True) for v in (*header, 0))
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "blob"
            path.write_bytes(bytes(self.data))
            r = subprocess.run([QEMU, str(lib.harness), op, str(path)], capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                raise RuntimeError(f"{op} under qemu failed ({r.returncode}): {r.stderr}")
            out = self.out = path.read_bytes()
        for off, ptr, nbytes in self.back:
            ctypes.memmove(ptr, out[off : off + nbytes], nbytes)
        lib.calls += 1
        return int.from_bytes(out[56:64], "little", signed=True)


class _Fn:
    """A callable that takes the argtypes / restype a ctypes function is given (cpu.check_abi sets them)."""

    def __init__(self, fn) -> None:
        self.fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)
