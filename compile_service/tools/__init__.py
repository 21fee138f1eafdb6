"""Tools built on the daemon and the client, outside the daemon's core (which never imports
the client): starting a daemon as a child process (launch), the demo workload (demo)."""
