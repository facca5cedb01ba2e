"""A seccomp filter for the sandbox (coordinator/sandbox.py): system calls model-written code has no use
for, refused with EPERM, so a kernel bug behind one of them is out of its reach.

bubblewrap installs no filter of its own; it loads a compiled classic-BPF program from a descriptor
(``--seccomp FD``) just before it executes the sandbox's command, and every process of the sandbox
inherits it. This module writes that program with the standard library: check the architecture (a
foreign one, or the x32 ABI, is refused outright: its numbers would mean other calls), then one
comparison per refused call.

A deny list, not an allow list: Python and the programs a model may start use a wide and changing set
of calls, and a call missing from an allow list breaks honest code in ways that are hard to see. The
list follows what Docker's default profile refuses that an unprivileged process could still reach
(those needing a capability already fail: the sandbox has none), plus the subsystems behind many recent
kernel escapes: io_uring, BPF, userfaultfd, perf events, keyrings, the new mount API.
"""

from __future__ import annotations

import errno
import platform
import struct

# Classic BPF, as in <linux/filter.h> and <linux/seccomp.h>.
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_NR_OFFSET = 0  # struct seccomp_data: int nr; __u32 arch; ...
_ARCH_OFFSET = 4
_X32_SYSCALL_BIT = 0x40000000
_MAX_JUMP = 255  # jump offsets are one byte

AUDIT_ARCH = {"x86_64": 0xC000003E}

# x86_64 numbers (arch/x86/entry/syscalls/syscall_64.tbl).
REFUSED_X86_64 = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "ustat": 136, "sysfs": 139, "vhangup": 153,
    "modify_ldt": 154, "pivot_root": 155, "_sysctl": 156, "acct": 163, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "create_module": 174,
    "init_module": 175, "delete_module": 176, "get_kernel_syms": 177, "query_module": 178,
    "quotactl": 179, "nfsservctl": 180, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "move_pages": 279, "perf_event_open": 298,
    "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430,
    "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442, "quotactl_fd": 443,
}
REFUSED = {"x86_64": REFUSED_X86_64}


class SeccompUnsupported(RuntimeError):
    """No filter is written for this machine's architecture."""


def _instruction(code: int, jt: int, jf: int, k: int) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def refusing_filter(machine: str | None = None) -> bytes:
    """The compiled filter for ``machine`` (this one by default): the refused calls answer EPERM, a
    foreign architecture or the x32 ABI kills the process, everything else is allowed."""
    machine = machine or platform.machine()
    if machine not in REFUSED:
        raise SeccompUnsupported(f"no seccomp filter is written for {machine!r} (only {sorted(REFUSED)})")
    numbers = sorted(set(REFUSED[machine].values()))
    n = len(numbers)
    if n + 4 > _MAX_JUMP:
        raise ValueError("too many refused calls for one-byte jumps")
    # Layout: 0 load arch, 1 arch check, 2 load nr, 3 x32 check, 4..4+n-1 one check per call,
    # 4+n allow, 5+n refuse (EPERM), 6+n kill. A jump offset counts from the next instruction.
    program = [
        _instruction(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        _instruction(_JEQ_K, 0, (6 + n) - 2, AUDIT_ARCH[machine]),
        _instruction(_LD_W_ABS, 0, 0, _NR_OFFSET),
        _instruction(_JGE_K, (6 + n) - 4, 0, _X32_SYSCALL_BIT),
    ]
    for index, number in enumerate(numbers):
        at = 4 + index
        program.append(_instruction(_JEQ_K, (5 + n) - (at + 1), 0, number))
    program += [
        _instruction(_RET_K, 0, 0, _RET_ALLOW),
        _instruction(_RET_K, 0, 0, _RET_ERRNO | errno.EPERM),
        _instruction(_RET_K, 0, 0, _RET_KILL_PROCESS),
    ]
    return b"".join(program)
