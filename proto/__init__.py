"""The wire contract (kernelservice.v1) and its generated Python stubs."""
