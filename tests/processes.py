"""The child processes a test leaves behind, and an engine core that never loads."""

# an engine core whose load never ends, for ``engine_core.client._BOOT`` (its command line
# names it as a core's does)
NEVER_LOADS = "import sys, time; sys.stdin.buffer.read(); time.sleep(600)  # engine_core"


def live_children(module: str, title: str) -> list:
    """This process's own children started as ``python -c`` of ``module``, or already named
    ``title...`` by themselves (not the processes of a server it runs: grandchildren)."""
    import psutil

    alive = []
    for child in psutil.Process().children():
        try:
            command = " ".join(child.cmdline())
            if child.status() != psutil.STATUS_ZOMBIE and (
                    module in command or command.startswith(title)):
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive
