"""Tools beside the library: benchmarks, the doctor, timelines (`python -m bench --help`,
`python -m bench.doctor --help`).

They run from a checkout of the repository (extra `bench`); `import pipeline` never loads them.
A tool run without one of its extras' modules says so in one line (`missing_extra`).
"""

import sys


def missing_extra(kind, error, tb, hook=sys.excepthook) -> None:
  """`sys.excepthook` for the tools: an uncaught ModuleNotFoundError of a module that one of
  the project's extras brings is one line naming the command and the extra; anything else
  goes to the previous hook."""
  from pipeline.host import extras

  main = getattr(sys.modules.get("__main__"), "__spec__", None)
  what = "python -m " + main.name.removesuffix(".__main__") if main else "this tool"
  line = issubclass(kind, ModuleNotFoundError) and extras.hint(error.name, what)
  if line:
    print(f"error: {line}", file=sys.stderr)
  else:
    hook(kind, error, tb)


sys.excepthook = missing_extra
