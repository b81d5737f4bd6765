#!/usr/bin/env python3
"""A stand-in for `nvidia-cuda-mps-control` (no GPU needed): `-f` serves a control socket in
$CUDA_MPS_PIPE_DIRECTORY and logs to $CUDA_MPS_LOG_DIRECTORY/control.log until it reads `quit`;
without arguments it sends its standard input to that socket, as the real one does.
$FAKE_MPS_FAIL=1: `-f` exits 1 at once. $FAKE_MPS_IGNORE_QUIT=1: `-f` never quits."""

import os
import socket
import sys
import time

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
control = os.path.join(pipe, "control")


def log(line: str) -> None:
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as f:
        f.write(f"{time.time():.6f} {line}\n")


if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        print("fake mps: cannot start the daemon (no GPU)", flush=True)
        sys.exit(1)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(control)
    server.listen(4)
    log(f"started pid {os.getpid()}")
    while True:
        conn, _ = server.accept()
        command = conn.recv(1024).decode().strip()
        conn.close()
        log(f"command {command}")
        if command == "quit" and not os.environ.get("FAKE_MPS_IGNORE_QUIT"):
            os.unlink(control)
            log("quit")
            sys.exit(0)
else:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(control)
    client.sendall(sys.stdin.read().encode())
    client.close()
