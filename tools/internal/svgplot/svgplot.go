// Package svgplot writes the parts of the horizontal bar charts that
// tools/benchplot, tools/peersplot and tools/benchpeers draw for
// docs/bench: the document's frame, text, bars and a dashed reference
// line. Each tool keeps its own layout; this package only writes the
// elements, so that a chart is spelled the same way in all three.
//
// Coordinates are ints or float64s: an int is written as it is, a float64
// to one decimal. Text is escaped for XML.
package svgplot

import (
	"fmt"
	"html"
	"io"
	"strconv"
)

// Number is a coordinate or a length.
type Number interface{ int | float64 }

func num[T Number](v T) string {
	if i, ok := any(v).(int); ok {
		return strconv.Itoa(i)
	}
	return strconv.FormatFloat(float64(v), 'f', 1, 64)
}

// Begin opens a document of width × height pixels whose text is
// sans-serif in fontSize pixels.
func Begin(w io.Writer, width, height, fontSize int) {
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="%d">`+"\n", width, height, fontSize)
}

// Background paints the whole document white, for viewers that show a
// transparent one dark.
func Background(w io.Writer) {
	io.WriteString(w, `<rect width="100%" height="100%" fill="white"/>`+"\n")
}

// End closes the document.
func End(w io.Writer) {
	io.WriteString(w, "</svg>\n")
}

// Text writes s with its baseline at (x, y); attrs, if not empty, are
// more attributes of the element (`text-anchor="end"`, `font-size="14"`).
func Text[X, Y Number](w io.Writer, x X, y Y, attrs, s string) {
	if attrs != "" {
		attrs = " " + attrs
	}
	fmt.Fprintf(w, `<text x="%s" y="%s"%s>%s</text>`+"\n", num(x), num(y), attrs, html.EscapeString(s))
}

// Label writes s ending at x: the name to the left of a bar.
func Label(w io.Writer, x, y int, s string) {
	Text(w, x, y, `text-anchor="end"`, s)
}

// Bar writes a rectangle filled with fill.
func Bar[X, L Number](w io.Writer, x X, y int, length L, height int, fill string) {
	fmt.Fprintf(w, `<rect x="%s" y="%d" width="%s" height="%d" fill="%s"/>`+"\n", num(x), y, num(length), height, fill)
}

// Reference writes a dashed vertical line at x from y1 to y2 and, centred
// under it, label: the mark bars are measured against (1.0 of a ratio).
func Reference(w io.Writer, x float64, y1, y2 int, label string) {
	fmt.Fprintf(w, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#333" stroke-dasharray="4,3"/>`+"\n", x, y1, x, y2)
	Text(w, x, y2+14, `text-anchor="middle"`, label)
}
