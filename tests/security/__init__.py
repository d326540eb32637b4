"""Who may do what: the documented ACL users, signatures, hostile clients, TLS, redaction."""
