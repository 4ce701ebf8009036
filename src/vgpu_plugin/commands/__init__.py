"""The command line: one module per command (thin edges over kubelet/ and node/)."""
