// Package mirror is the replicated mapping of rnbd-client: one device
// over 2 or 3 legs, each an RNBD device on a different storage node, and
// an optional witness that holds only metadata. docs/replication.md is
// the design: the metadata format, the generations and quorums, each
// failure and what the mirror does.
//
// What is here so far is the part every other one rests on: the
// superblock (superblock.go: its format, the checks of every field, the
// choice between its two slots), the assembly's decision (assemble.go:
// from the superblocks of the voters reached, which legs hold the last
// acknowledged writes, which resync, or a refusal naming what is
// missing), both pure functions of their input, and the dirty-region
// bitmap (bitmap.go: the bits a write sets before it goes out, the
// blocks it waits for, cleaning, the union loaded at assembly, the runs
// a resync copies), and the mirror itself: mirror.go (Create, Open —
// assemble, commit —, the worker), reconcile.go (the legs made
// identical at assembly, the bitmap cleaned), mirror_io.go (Submit, the
// IO over rnbd.CltDev legs), resync.go (a leg rejoining while mapped),
// repair.go (a bad block rewritten), witness.go (the witness dialled
// again) and voter.go (a leg's or the witness's device, its timeout and
// reopens). docs/replication.md says what it does not do yet.
//
// Lock order: Mirror.metaMu (metadata IO, the superblock), then
// Bitmap.mu; Mirror.heldMu and Bitmap.mu are leaves. No IO completion
// takes metaMu: a leg's failure is committed by the mirror's worker.
package mirror
