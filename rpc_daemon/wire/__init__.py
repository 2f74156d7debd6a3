"""The wire format, shared by the client and the daemon: framing and field checks
(protocol), the graph codec, what a graph may hold (graph_limits), the HELLO/AUTH
handshake, TLS contexts, socket options, a llama.cpp client's HELLO (llamacpp)."""
