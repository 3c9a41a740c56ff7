package svgplot

import (
	"strings"
	"testing"
)

func TestElements(t *testing.T) {
	var b strings.Builder
	Begin(&b, 100, 50, 12)
	Background(&b)
	Label(&b, 40, 20, `a<b & "c"`)
	Bar(&b, 48, 5, 17, 22, "#3b6ea8")
	Bar(&b, 48, 5, 17.25, 22, "#3b6ea8")
	Text(&b, 65.04, 20, `font-size="11"`, "1.50×")
	Reference(&b, 60, 4, 26, "1.0")
	End(&b)
	want := `<svg xmlns="http://www.w3.org/2000/svg" width="100" height="50" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="40" y="20" text-anchor="end">a&lt;b &amp; &#34;c&#34;</text>
<rect x="48" y="5" width="17" height="22" fill="#3b6ea8"/>
<rect x="48" y="5" width="17.2" height="22" fill="#3b6ea8"/>
<text x="65.0" y="20" font-size="11">1.50×</text>
<line x1="60.0" y1="4" x2="60.0" y2="26" stroke="#333" stroke-dasharray="4,3"/>
<text x="60.0" y="40" text-anchor="middle">1.0</text>
</svg>
`
	if got := b.String(); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}
