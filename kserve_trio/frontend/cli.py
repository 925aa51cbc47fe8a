"""``python -m kserve_trio frontend``: one front-end process of a worker. The worker's device
process starts it (``endpoints.frontend_processes`` > 1) with the descriptors it inherits named
on the command line; it is not meant to be run by hand."""

from __future__ import annotations

import argparse
import os
import socket
import sys


def configure_parser(parser: argparse.ArgumentParser):
    parser.add_argument("--channel-fd", type=int, required=True, help="the channel socket")
    parser.add_argument("--request-arena-fd", type=int, required=True, help="the request arena")
    parser.add_argument("--reply-arena-fd", type=int, required=True, help="the reply arena")
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    parser.add_argument("--log-level", default="info")
    return run


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: every command's parser is built for ``--help``, and only
    # this command needs the front end's servers.
    from kserve_trio.core.logging import configure_logging
    from kserve_trio.frontend.process import serve_frontend
    from kserve_trio.serving.background import run_loop
    from kserve_trio.serving.fd_budget import raise_open_file_limit
    from kserve_trio.serving.ipc import Arena, ChannelClosed, read_hello

    configure_logging(args.log_format, args.log_level)
    raise_open_file_limit()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=args.channel_fd)
    arenas = []
    for fd in (args.request_arena_fd, args.reply_arena_fd):
        arenas.append(Arena(fd, os.fstat(fd).st_size))
        os.close(fd)  # the mapping holds its own descriptor
    try:
        hello = read_hello(sock)
    except (ChannelClosed, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return run_loop(
        serve_frontend, hello, sock, *arenas, event_loop=hello.config.endpoints.event_loop or None
    )


__all__ = ["configure_parser", "run"]
