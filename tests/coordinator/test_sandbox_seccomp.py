"""The sandbox's seccomp filter as a program: its shape, without loading it (test_sandbox.py loads it)."""

from __future__ import annotations

import struct

import pytest

from veriroll.coordinator import seccomp


def _instructions(program: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack("=HBBI", program[at:at + 8]) for at in range(0, len(program), 8)]


def test_every_refused_call_jumps_to_eperm_and_the_rest_is_allowed():
    program = _instructions(seccomp.refusing_filter("x86_64"))
    numbers = sorted(set(seccomp.REFUSED_X86_64.values()))
    assert len(program) == len(numbers) + 7
    allow, refuse, kill = program[-3:]
    assert allow == (0x06, 0, 0, 0x7FFF0000)
    assert refuse == (0x06, 0, 0, 0x00050000 | 1)  # SECCOMP_RET_ERRNO | EPERM
    assert kill == (0x06, 0, 0, 0x80000000)
    refuse_at = len(program) - 2
    for index, (code, jt, jf, k) in enumerate(program[4:-3], start=4):
        assert (code, jf, k) == (0x15, 0, numbers[index - 4])
        assert index + 1 + jt == refuse_at


def test_foreign_architecture_and_x32_calls_are_killed():
    program = _instructions(seccomp.refusing_filter("x86_64"))
    kill_at = len(program) - 1
    load_arch, arch_check, load_nr, x32_check = program[:4]
    assert load_arch == (0x20, 0, 0, 4) and load_nr == (0x20, 0, 0, 0)
    assert arch_check[3] == 0xC000003E and 2 + arch_check[2] == kill_at
    assert x32_check[3] == 0x40000000 and 4 + x32_check[1] == kill_at


def test_unknown_architecture_is_refused():
    with pytest.raises(seccomp.SeccompUnsupported, match="riscv64"):
        seccomp.refusing_filter("riscv64")
