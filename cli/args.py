"""The `kvstrata` command line on Click: validated parameter types and one-line errors.

Every command is a `click.Command` in its own module; `invoke` runs one with kvstrata's
error convention: a user mistake (a negative size, a file where a directory belongs, a
missing trace, an unknown command) ends with one line naming the bad value,
`kvstrata <command>: error: ...`, and exit code 2, before anything runs. A bad value met
while running (a `KVStoreError`, an `OSError`) is one line too. `--help` is each command's own.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from kvstore.errors import KVStoreError

if TYPE_CHECKING:  # Click's stubs type a parameter type by the values it makes and takes
    ParamType = click.ParamType[Any, Any]
else:
    ParamType = click.ParamType

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def positive() -> click.IntRange:
    return click.IntRange(min=1)


def nonneg() -> click.IntRange:
    return click.IntRange(min=0)


class IntList(ParamType):
    """A non-empty comma list of ints, each in [low, high]."""

    name = "list"

    def __init__(self, low: int, high: int | None = None) -> None:
        self.low, self.high = low, high

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        items = [x.strip() for x in str(value).split(",") if x.strip()]
        if not items:
            self.fail(f"{value!r} lists no value", param, ctx)
        out = []
        for item in items:
            try:
                number = int(item)
            except ValueError:
                self.fail(f"{item!r} is not an integer", param, ctx)
            if number < self.low or (self.high is not None and number > self.high):
                bound = f">= {self.low}" if self.high is None else f"in [{self.low}, {self.high}]"
                self.fail(f"{number} is not {bound}", param, ctx)
            out.append(number)
        return out


class Choices(ParamType):
    """A non-empty comma list of names from `known`."""

    name = "list"

    def __init__(self, known: Sequence[str], normalize: Callable[[str], str] = str) -> None:
        self.known, self.normalize = list(known), normalize

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[str]:
        if isinstance(value, list):
            return value
        items = [self.normalize(x.strip()) for x in str(value).split(",") if x.strip()]
        bad = [x for x in items if x not in self.known]
        if bad or not items:
            self.fail(f"{value!r}: choose from {', '.join(self.known)}", param, ctx)
        return items


def directory_problem(text: str) -> str | None:
    """Why `text` cannot be (or become) a directory, or None."""
    if not text or "\x00" in text:
        return f"{text!r} is not a usable path"
    probe = text
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip(os.sep))
    if probe and not os.path.isdir(probe):
        return f"{text!r} is not a directory ({probe!r} is a file)"
    if not os.access(probe or ".", os.W_OK | os.X_OK):
        return f"{text!r} cannot be written ({os.path.abspath(probe or '.')!r} is not writable)"
    return None


class Directory(ParamType):
    """A path that is a directory or can become one (not a file)."""

    name = "directory"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        problem = directory_problem(str(value))
        if problem is not None:
            self.fail(problem, param, ctx)
        return str(value)

    def shell_complete(self, ctx: click.Context, param: click.Parameter, incomplete: str) -> list[Any]:
        from click.shell_completion import CompletionItem

        return [CompletionItem(incomplete, type="dir")]


class Device(ParamType):
    """`cpu`, `cuda` or `cuda:N`, present on this machine (the one line names the bad value)."""

    name = "device"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        import torch

        try:
            device = torch.device(str(value))
        except RuntimeError:
            self.fail(f"{value!r} is not a device: use cpu, cuda or cuda:N", param, ctx)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0:
                self.fail(f"{value!r}: this machine has no CUDA device PyTorch {torch.__version__} can use; "
                          "use --device cpu", param, ctx)
            if device.index is not None and device.index >= count:
                self.fail(f"{value!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}", param, ctx)
        elif device.type != "cpu":
            self.fail(f"{value!r}: use cpu, cuda or cuda:N", param, ctx)
        return str(device)


class MemoryNeedError(KVStoreError, ValueError):
    """The sizes asked for need more memory than the machine has available."""


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux `MemAvailable`), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(need_bytes: int, what: str) -> None:
    """Raise `MemoryNeedError` (one line naming `what`) if `need_bytes` exceed the memory
    available now; where that is unknown, do nothing."""
    have = available_memory()
    if have is not None and need_bytes > have:
        raise MemoryNeedError(f"{what} needs about {need_bytes / 2**30:.1f} GiB of memory and "
                              f"{have / 2**30:.1f} GiB is available: ask for less")


class MissingPackageError(KVStoreError, RuntimeError):
    """A command needs an optional package this Python lacks."""


def require_packages(packages: Sequence[str], purpose: str, install: str) -> None:
    """Raise `MissingPackageError` (one line: what is missing, which Python, `install`) unless
    this Python can import every one of `packages` (looked up, not imported)."""
    import importlib.util

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise MissingPackageError(f"{purpose} needs {', '.join(missing)}, which {sys.executable} cannot import: "
                                  f"{install}")


VLLM_PACKAGES = ("vllm", "transformers", "tokenizers")  # the engine, and the tiny model's build
VLLM_INSTALL = ("install the vllm extra (pip install 'kvstrata[vllm]'; in a checkout: bash scripts/setup_vllm.sh) "
                "and run this with that environment's kvstrata (.venv-vllm/bin/kvstrata)")


class ByteSize(ParamType):
    """A byte count such as 1073741824, '512MiB' or '4G' (K/M/G/T are powers of 1024); the
    text is kept (the value passes on as given)."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from kvstore.errors import ConfigError
        from kvstore.settings import parse_bytes

        try:
            parse_bytes(param.name if param is not None and param.name else "size", str(value))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


class OutputFile(ParamType):
    """A file path to write: not a directory, in a directory that is (or can become) writable."""

    name = "file"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if os.path.isdir(text):
            self.fail(f"{text!r} is a directory, not a file", param, ctx)
        problem = directory_problem(os.path.dirname(text) or ".")
        if problem is not None:
            self.fail(f"{text!r}: {problem}", param, ctx)
        return text


def existing_file() -> click.Path:
    return click.Path(exists=True, dir_okay=False)


def check_environment() -> str | None:
    """What is wrong with the `KVSTRATA_*` variables (an unknown one, a bad value, a results
    directory that is a file), or None."""
    from cli.settings import environment_problem

    return environment_problem(directory_problem)


class CommandFailed(click.ClickException):
    """A bad value met while `command_path` ran (a `KVStoreError` or `OSError`), one line."""

    def __init__(self, command_path: str, message: str) -> None:
        super().__init__(message)
        self.command_path = command_path


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def invoke(command: click.Command, argv: Sequence[str] | None, prog: str) -> int:
    """Run `command` on `argv` (default: the process's) as `prog`; the exit code it means.

    User mistakes print one line and give 2; `--help` prints the command's help and gives 0.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = command.main(args=args, prog_name=prog, standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:  # a group run without a command: its help
        print(exc.format_message())
        return 2
    except CommandFailed as exc:
        return fail(exc.command_path, " ".join(exc.format_message().split()))
    except click.ClickException as exc:
        where = exc.ctx.command_path if isinstance(exc, click.UsageError) and exc.ctx is not None else prog
        return fail(where, " ".join(exc.format_message().split()))
    except click.Abort:
        return fail(prog, "aborted")
    except (KVStoreError, OSError) as exc:  # a bad value met at run time: no traceback
        return fail(prog, str(exc))
    return int(result or 0) if isinstance(result, (int, type(None))) else 0
