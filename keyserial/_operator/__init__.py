"""What an operator reads and does to a namespace (status, dead letters, paused keys), for the
``keyserial`` command and the dashboard alike: each prints or serves what these return."""
