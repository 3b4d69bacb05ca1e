"""A TCP proxy in front of the real ClickHouse server, for fault injection.

The server, the driver and the catalog are real; only the connection between them is
interfered with, in the ways a network can fail and nothing else can reproduce on demand:

* :meth:`CuttingProxy.cut_after` — when given bytes appear in what the client sends, pass
  them (and the rest of the statement) to the server, give the server time to execute it,
  then close both sides *without* passing the server's answer back. The statement has
  landed; the client cannot know.
* :meth:`CuttingProxy.hold` / :meth:`release` — when given bytes appear, stop forwarding
  the client's bytes (from that chunk on) until released: a writer paused mid-statement.
* :attr:`CuttingProxy.refusing` — close every new connection at once (nothing is sent).

Triggers match the native protocol's bytes: a String value is sent as a varint length and
the UTF-8 bytes, and every Data block header carries each column's name and type the same
way, e.g. ``b"\\x05claim"`` (a ``kind`` value) or ``b"\\x08pack_ids\\x0dArray(String)"``.
"""

from __future__ import annotations

import socket
import threading
import time


class _Conn:
    def __init__(self, proxy: CuttingProxy, client: socket.socket, server: socket.socket):
        self.proxy = proxy
        self.client = client
        self.server = server
        self.cut = False
        self.held: list[bytes] | None = None
        self.closed = False
        self.lock = threading.Lock()

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def pump_up(self) -> None:
        tail = b""
        try:
            while True:
                data = self.client.recv(65536)
                if not data:
                    break
                window = tail + data
                tail = window[-64:]
                proxy = self.proxy
                with proxy.lock:
                    cut = proxy._cut_trigger is not None and proxy._cut_trigger in window
                    if cut:
                        proxy._cut_trigger = None
                    hold = proxy._hold_trigger is not None and proxy._hold_trigger in window
                    if hold:
                        proxy._hold_trigger = None
                        self.held = []
                        proxy._held_conn = self
                        proxy.held_event.set()
                    if self.held is not None:
                        self.held.append(data)
                        continue
                if cut:
                    self.cut = True
                self.server.sendall(data)
                if cut:
                    threading.Thread(target=self._cut_later, daemon=True).start()
        except OSError:
            pass
        finally:
            self.close()

    def _cut_later(self) -> None:
        time.sleep(self.proxy.settle)
        self.proxy.cuts += 1
        self.close()
        self.proxy.cut_event.set()

    def flush_held(self) -> None:
        with self.proxy.lock:  # the pump waits on this lock, so nothing overtakes held bytes
            held, self.held = self.held or [], None
            try:
                for chunk in held:
                    self.server.sendall(chunk)
            except OSError:
                self.close()

    def pump_down(self) -> None:
        try:
            while True:
                data = self.server.recv(65536)
                if not data:
                    break
                if self.cut:
                    continue  # the answer never reaches the client
                self.client.sendall(data)
        except OSError:
            pass
        finally:
            if not self.cut:
                self.close()


class CuttingProxy:
    def __init__(self, target_host: str, target_port: int, *, settle: float = 0.5):
        self.target = (target_host, target_port)
        self.settle = settle
        self.lock = threading.Lock()
        self.refusing = False
        self.cuts = 0
        self.cut_event = threading.Event()
        self.held_event = threading.Event()
        self._cut_trigger: bytes | None = None
        self._hold_trigger: bytes | None = None
        self._held_conn: _Conn | None = None
        self._conns: list[_Conn] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.host, self.port = self._listener.getsockname()
        self._stopping = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def uri(self, database: str, user: str = "default", password: str = "") -> str:
        return f"clickhouse://{user}:{password}@{self.host}:{self.port}/{database}"

    def cut_after(self, trigger: bytes) -> None:
        """Arm: the next statement whose bytes contain ``trigger`` lands, then the line dies."""
        with self.lock:
            self.cut_event.clear()
            self._cut_trigger = trigger

    def hold(self, trigger: bytes) -> None:
        """Arm: from the chunk containing ``trigger`` on, the client's bytes wait for release()."""
        with self.lock:
            self.held_event.clear()
            self._hold_trigger = trigger

    def release(self) -> None:
        with self.lock:
            conn, self._held_conn = self._held_conn, None
        if conn is not None:
            conn.flush_held()

    def _accept(self) -> None:
        while not self._stopping:
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            if self.refusing or self._stopping:
                client.close()
                continue
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client, server)
            self._conns.append(conn)
            threading.Thread(target=conn.pump_up, daemon=True).start()
            threading.Thread(target=conn.pump_down, daemon=True).start()

    def close(self) -> None:
        self._stopping = True
        self._thread.join(5)
        self._listener.close()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
