// Package e2e runs the real binaries as processes: as root, in network
// namespaces joined by veth pairs, so paths can be cut like cables. Its
// tests skip, saying why, when not run as root.
package e2e
