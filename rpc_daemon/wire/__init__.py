"""The wire format, shared by the client and the daemon: framing and field checks
(protocol), the graph codec, the HELLO/AUTH handshake, TLS contexts, socket options."""
