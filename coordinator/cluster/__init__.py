"""The connections to workers: executors (a remote worker or this process), endpoint state
(latching, reconnecting, health) and the I/O thread they all run on."""
