"""Running a seccomp filter (classic BPF) on one syscall, to see whether it refuses it.

A forged image could keep seccomp in filter mode and swap the sandbox's
filter for one that allows everything.  The posture check therefore runs
each restored thread's filter chain, as the kernel would, on every syscall
the sandbox's posture refuses, and wants a refusal back.

A program is ``struct sock_filter[]``: 8 bytes each, ``u16 code, u8 jt,
u8 jf, u32 k`` (little-endian).  It reads ``struct seccomp_data``: ``int nr``
at 0, ``u32 arch`` at 4, ``u64 instruction_pointer`` at 8, ``u64 args[6]``
at 16.  The kernel runs every filter of a chain and keeps the most
restrictive action; so a syscall is refused when any filter returns KILL,
TRAP or ERRNO for it.

Only the opcodes libseccomp and runc emit are interpreted (loads from the
data, immediate loads, scratch memory, ALU with a constant, jumps, returns).
A filter with any other opcode, one that runs off its end, or one with more
than MAX_PATHS ways through it cannot be judged and counts as allowing
everything: a chain passes only if a filter
crab can read refuses.  Programs only jump forward (the kernel's checker
refuses the rest), so a run takes at most one step per instruction.
"""

from __future__ import annotations

import functools
import struct

#: AUDIT_ARCH_X86_64 and AUDIT_ARCH_I386: the entry points checked.  An x86_64 process can enter
#: the kernel the i386 way (int 0x80) where IA32 emulation is on (it is on this host kind);
#: x32 (X86_64 numbers | 0x40000000) is off in this kernel (CONFIG_X86_X32_ABI unset), not checked.
AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
#: SECCOMP_RET_ACTION_FULL mask, and the actions that refuse a syscall.
_ACTION_MASK = 0xFFFF0000
_REFUSING = {0x80000000, 0x00000000, 0x00030000, 0x00050000}  # KILL_PROCESS, KILL_THREAD, TRAP, ERRNO
#: Longest program the kernel accepts (BPF_MAXINSNS).
MAX_INSNS = 4096
_M32 = 0xFFFFFFFF


#: Numbers of the syscalls a sandbox's posture refuses, per entry point (asm/unistd_64.h, unistd_32.h);
#: a name missing from one (kexec_file_load on i386, vm86 on x86_64) is not checked there.
SYSCALLS = {
    AUDIT_ARCH_X86_64: {
        "syslog": 103, "uselib": 134, "pivot_root": 155, "acct": 163, "mount": 165, "umount2": 166,
        "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173, "init_module": 175,
        "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
        "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298, "fanotify_init": 300,
        "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
        "process_vm_writev": 311, "finit_module": 313, "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "clone3": 435, "mount_setattr": 442,
    },
    AUDIT_ARCH_I386: {
        "mount": 21, "acct": 51, "umount2": 52, "uselib": 86, "swapon": 87, "reboot": 88, "ioperm": 101,
        "syslog": 103, "iopl": 110, "vm86old": 113, "swapoff": 115, "init_module": 128, "delete_module": 129,
        "quotactl": 131, "vm86": 166, "pivot_root": 217, "lookup_dcookie": 253, "kexec_load": 283,
        "add_key": 286, "request_key": 287, "keyctl": 288, "unshare": 310, "perf_event_open": 336,
        "fanotify_init": 338, "name_to_handle_at": 341, "open_by_handle_at": 342, "setns": 346,
        "process_vm_readv": 347, "process_vm_writev": 348, "finit_module": 350, "bpf": 357, "userfaultfd": 374,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "clone3": 435, "mount_setattr": 442,
    },
}  # fmt: skip
ARCH_NAMES = {AUDIT_ARCH_X86_64: "x86_64", AUDIT_ARCH_I386: "i386"}


class Unjudged(Exception):
    """The program uses what this interpreter does not model."""


#: Paths a run may follow (each jump on a value the caller chooses forks one): beyond, the filter is unjudged.
MAX_PATHS = 4096
#: Offset in ``struct seccomp_data`` where what the caller chooses begins (instruction pointer, arguments).
_CALLER_CHOSEN = 8
#: What a return of an unknown accumulator counts as: allowing.
_ALLOW = 0x7FFF0000


def _alu(op: int, a: int, k: int) -> int:
    if op == 0x00:
        return (a + k) & _M32
    if op == 0x10:
        return (a - k) & _M32
    if op == 0x20:
        return (a * k) & _M32
    if op == 0x40:
        return a | k
    if op == 0x50:
        return a & k
    if op == 0x60:
        return (a << k) & _M32 if k < 32 else 0
    if op == 0x70:
        return a >> k if k < 32 else 0
    if op == 0x80:
        return (-a) & _M32
    if op == 0xA0:
        return a ^ k
    raise Unjudged(f"ALU op {op:#x}")


@functools.lru_cache(maxsize=32)
def _decode(program: bytes) -> tuple[tuple[int, int, int, int], ...]:
    """The instructions of ``program`` (decoded once: every refused syscall runs it again)."""
    if len(program) % 8 or not 0 < len(program) // 8 <= MAX_INSNS:
        raise Unjudged("not a whole program")
    return tuple(struct.iter_unpack("<HBBI", program))


def actions(program: bytes, nr: int, arch: int = AUDIT_ARCH_X86_64) -> set[int]:
    """Every action ``program`` can return for syscall ``nr`` entered as ``arch``, whatever the arguments.

    The syscall number and architecture are known; the instruction pointer and the
    six arguments are the caller's to choose, so a load of them gives an unknown
    value (None) and a jump that tests one follows both ways.  A filter that
    refuses ``mount`` only when its first argument is 0 therefore does not count
    as refusing it.  A return of an unknown value counts as allowing.
    """
    insns = _decode(program)
    todo: list[tuple[int, int | None, int | None, tuple[int | None, ...]]] = [(0, 0, 0, (0,) * 16)]
    out: set[int] = set()
    paths = 0
    while todo:
        paths += 1
        if paths > MAX_PATHS:
            raise Unjudged("too many paths")
        pc, a, x, mem = todo.pop()
        while True:
            if pc >= len(insns):
                raise Unjudged("ran off the end")
            code, jt, jf, k = insns[pc]
            pc += 1
            cls = code & 0x07
            if code == 0x20:  # LD W ABS
                if k % 4 or k + 4 > _CALLER_CHOSEN + 8 * 6:
                    raise Unjudged(f"load at {k}")
                a = nr & _M32 if k == 0 else arch if k == 4 else None
            elif code == 0x00:  # LD IMM
                a = k
            elif code == 0x01:  # LDX IMM
                x = k
            elif code in (0x60, 0x61, 0x02, 0x03):  # LD MEM, LDX MEM, ST, STX
                if k >= 16:
                    raise Unjudged("scratch memory index")
                if code == 0x60:
                    a = mem[k]
                elif code == 0x61:
                    x = mem[k]
                else:
                    mem = (*mem[:k], a if code == 0x02 else x, *mem[k + 1 :])
            elif code == 0x07:  # TAX
                x = a
            elif code == 0x87:  # TXA
                a = x
            elif cls == 0x04:  # ALU, K or X
                b = x if code & 0x08 else k
                a = None if a is None or b is None else _alu(code & 0xF0, a, b)
            elif code == 0x05:  # JA
                pc += k
            elif cls == 0x05:  # JEQ/JGT/JGE/JSET, K or X
                b = x if code & 0x08 else k
                op = code & 0xF0
                if op not in (0x10, 0x20, 0x30, 0x40):
                    raise Unjudged(f"jump op {op:#x}")
                if a is None or b is None:
                    todo.append((pc + jf, a, x, mem))  # the caller may pick either way
                    pc += jt
                    continue
                taken = a == b if op == 0x10 else a > b if op == 0x20 else a >= b if op == 0x30 else bool(a & b)
                pc += jt if taken else jf
            elif code == 0x06:  # RET K
                out.add(int(k))
                break
            elif code == 0x16:  # RET A
                out.add(_ALLOW if a is None else int(a))
                break
            else:
                raise Unjudged(f"opcode {code:#x}")
    return out


def refuses(chain: list[bytes], nr: int, arch: int = AUDIT_ARCH_X86_64) -> bool:
    """Whether any filter of ``chain`` that crab can judge refuses syscall ``nr`` entered as ``arch``."""
    for program in chain:
        try:
            found = actions(program, nr, arch)
        except Unjudged:
            continue
        if all(action & _ACTION_MASK in _REFUSING for action in found):
            return True
    return False
