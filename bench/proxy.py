"""A loopback TCP proxy that takes a database away and brings it back (outage runs).

bench.faults and the outage tests share it (bench is installed; tests are not).

Example:
    proxy = TcpProxy(("127.0.0.1", 5432))
    proxy.start()    # connect to 127.0.0.1:proxy.port instead of the database
    proxy.stop()     # the database "goes away", open connections included
"""

from __future__ import annotations

import contextlib
import socket
import threading

from monitor.loopback import free_port


class TcpProxy:
    """Forward 127.0.0.1:port to `target`; `stop()` cuts every connection and refuses new ones."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._server: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        """Accept and forward connections."""
        server = socket.create_server(("127.0.0.1", self.port))
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                return
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Cut: close the listener (shutdown wakes accept()) and every open connection."""
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
            self._server = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


# -- the service on a fake engine ---------------------------------------------------------
