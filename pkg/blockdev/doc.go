// Package blockdev is the operating system's block storage an RNBD
// server serves an export from: a regular file or a block device, with
// flush, FUA, discard and write-zeroes mapped exactly. The client's
// frontends are in pkg/frontend.
//
// Lock order (outermost first):
//
//	Backend.capMu (Cap)
//	  Backend.sizeMu
//	    fileMap.mu (serve, under sizeMu, forgets or walks the pages: resized)
//	populating (a populate step)
//	  fileMap.mu
//
// maps.mu and mtimeStamp.mu are each taken alone: mapInit and unmap let
// maps.mu go before they touch a fileMap, and stampMtime takes nothing
// under its lock. Refresh and PollSize let sizeMu go before they remap
// (fileMap.mu).
package blockdev
