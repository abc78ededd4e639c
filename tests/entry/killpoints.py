"""Run one of the project's commands in a child process that is killed (os._exit, no cleanup, as
SIGKILL) just before its N-th rename: the fault injected between the steps of an atomic write.

    python -m tests.entry.killpoints N train.py ARGS...         # a script of the repository
    python -m tests.entry.killpoints N -m data.generate ARGS... # a module

Every rename the project makes goes through os.replace, os.rename (Path.rename and Path.replace
call them) or data.atomic's exchange; each is counted. Exit status 137 when killed; else the command's own, and the number of
renames it made on the last line of stderr ("renames: K")."""

import os
import runpy
import sys

KILLED = 137


def install(kill_at: int) -> list[int]:
    import data.atomic

    count = [0]

    def counted(real):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] == kill_at:
                os._exit(KILLED)
            return real(*args, **kwargs)
        return call
    os.replace = counted(os.replace)
    os.rename = counted(os.rename)
    data.atomic._exchange = counted(data.atomic._exchange)
    return count


def main() -> None:
    kill_at, *command = sys.argv[1:]
    count = install(int(kill_at))
    status = 0
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = command
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    print(f"renames: {count[0]}", file=sys.stderr)
    sys.exit(status)


if __name__ == "__main__":
    main()
